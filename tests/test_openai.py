"""Issue 14 (OpenAI): /v1/completions and /v1/chat/completions on the real launch script, driven
with the real ``openai`` client (and raw httpx where the wire matters): non-stream and SSE,
n > 1, list prompts, stop strings split across tokens, seeds (reproducible, and the same tokens
as /infer_token), usage counts, logprobs (once the device workers produce them), the benchmark
fields, and OpenAI-shaped errors."""
from __future__ import annotations

import concurrent.futures
import json
import math
import threading
import time

import httpx
import pytest

from mindie.text.chat_template import load_chat_template
from mindie.text.detokenizer import load_tokenizer
from tests.harness import Server, demo_server, free_port, short_run_dir, write_config
from tests.lazy_modules import lazy_module

openai = lazy_module("openai")  # imported where a test uses it (tests/lazy_modules.py)

pytestmark = pytest.mark.timeout(600)

MAX_LINK = 4
MAX_N = 4  # ScheduleConfig.maxN of the server: test_max_n_caps_the_choices
PROMPT = "The quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, who are you?"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory, demo_model):
    with demo_server(tmp_path_factory.mktemp("openai"), demo_model, env={"MINDIE_LLM_BENCHMARK_ENABLE": "1"},
                     server={"maxLinkNum": MAX_LINK}, schedule={"maxIterTimes": 1024, "maxN": MAX_N}) as s:
        s.tok = load_tokenizer(demo_model)
        s.template = load_chat_template(demo_model)
        s.oai = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
        yield s


def _native(srv, ids, **params) -> list[int]:
    r = httpx.post(srv.url + "/infer_token", json={"input_id": ids, "parameters": {"details": True, **params}},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["details"]["generated_token_ids"]


def _sse(r: httpx.Response) -> list:
    """The events of an SSE body: dicts, and "[DONE]" last."""
    body = r.text
    assert body.endswith("data: [DONE]\n\n"), body[-300:]
    events = []
    for frame in body.split("\n\n")[:-1]:
        assert frame.startswith("data: "), frame
        data = frame[6:]
        events.append(data if data == "[DONE]" else json.loads(data))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events


# -- completions ------------------------------------------------------------------------------------
def test_completion_shape_and_usage(srv):
    r = srv.oai.completions.create(model="demo", prompt=PROMPT, max_tokens=9, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == "demo"
    assert abs(r.created - time.time()) < 60
    [c] = r.choices
    assert c.index == 0 and c.finish_reason == "length" and c.logprobs is None
    assert r.usage.prompt_tokens == len(srv.tok.encode(PROMPT))
    assert r.usage.completion_tokens == 9
    assert r.usage.total_tokens == r.usage.prompt_tokens + 9
    # the same greedy tokens as the native route
    ids = _native(srv, srv.tok.encode(PROMPT), max_new_tokens=9, ignore_eos=True)
    assert c.text == srv.tok.decode(ids)


def test_default_max_tokens_is_maxitertimes_capped(srv):
    # MindIE's default: maxIterTimes (1024 here), so an ignore_eos request runs past OpenAI's 16.
    r = srv.oai.completions.create(model="demo", prompt=[5, 6, 7], temperature=0, extra_body={"ignore_eos": True},
                                   stream=False, max_tokens=None)
    assert r.usage.completion_tokens == 1024 and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("params", [{"temperature": 0.8, "top_k": 20, "seed": 1234},
                                    {"temperature": 1.3, "top_p": 0.9, "seed": 7},
                                    {"temperature": 0.5, "seed": 99, "repetition_penalty": 1.2}])
def test_seeded_sampling_same_as_native_and_reproducible(srv, params):
    ids = srv.tok.encode(PROMPT)
    native = _native(srv, ids, max_new_tokens=12, ignore_eos=True, **params)
    extra = {"ignore_eos": True, **{k: v for k, v in params.items() if k in ("top_k", "repetition_penalty")}}
    kw = dict(model="demo", prompt=ids, max_tokens=12, temperature=params["temperature"], seed=params["seed"],
              top_p=params.get("top_p"), extra_body=extra)
    a = srv.oai.completions.create(**kw)
    b = srv.oai.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text == srv.tok.decode(native)
    assert a.usage.prompt_tokens == len(ids) and a.usage.completion_tokens == 12


def test_n_choices_use_seed_plus_index(srv):
    kw = dict(model="demo", prompt=PROMPT, max_tokens=10, temperature=1.0, extra_body={"ignore_eos": True})
    r = srv.oai.completions.create(n=3, seed=500, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for j, c in enumerate(r.choices):
        single = srv.oai.completions.create(seed=500 + j, **kw)
        assert c.text == single.choices[0].text
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.prompt_tokens == len(srv.tok.encode(PROMPT))  # once, not once per choice
    assert r.usage.completion_tokens == 30


def test_max_n_caps_the_choices(srv):
    """ScheduleConfig.maxN bounds n x prompts per request (400 naming it); at the bound it serves."""
    ok = srv.oai.completions.create(model="demo", prompt=["a", "b"], n=MAX_N // 2, max_tokens=1)
    assert len(ok.choices) == MAX_N
    for kw in ({"prompt": "a", "n": MAX_N + 1}, {"prompt": ["a", "b", "c"], "n": 2}):
        with pytest.raises(openai.BadRequestError) as e:
            srv.oai.completions.create(model="demo", max_tokens=1, **kw)
        assert "ScheduleConfig.maxN" in str(e.value) and e.value.body["param"] == "n", e.value
    with pytest.raises(openai.BadRequestError):
        srv.oai.chat.completions.create(model="demo", messages=MESSAGES, n=MAX_N + 1, max_completion_tokens=1)


def test_list_prompts(srv):
    prompts = ["Hello there", "Another prompt, longer than the first one"]
    r = srv.oai.completions.create(model="demo", prompt=prompts, n=2, max_tokens=5, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        single = srv.oai.completions.create(model="demo", prompt=prompt, max_tokens=5, temperature=0,
                                            extra_body={"ignore_eos": True})
        assert r.choices[2 * p].text == r.choices[2 * p + 1].text == single.choices[0].text
    assert r.usage.prompt_tokens == sum(len(srv.tok.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == 20
    ids = [srv.tok.encode(p) for p in prompts]
    r2 = srv.oai.completions.create(model="demo", prompt=ids, max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in r2.choices] == [r.choices[0].text, r.choices[2].text]


def test_echo(srv):
    r = srv.oai.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                   extra_body={"ignore_eos": True})
    plain = srv.oai.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].text == PROMPT + plain.choices[0].text
    assert r.usage == plain.usage
    # streamed: the prompt comes in the first chunk; with logprobs its tokens come first too
    text, tokens = "", []
    for chunk in srv.oai.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                            logprobs=1, stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            text += c.text
            tokens += c.logprobs.tokens
    assert text == r.choices[0].text
    assert len(tokens) == len(srv.tok.encode(PROMPT)) + 4


def test_stream_completion(srv):
    kw = dict(model="demo", prompt=PROMPT, max_tokens=15, temperature=0.9, seed=3, n=2,
              extra_body={"ignore_eos": True})
    full = srv.oai.completions.create(**kw)
    texts, finish, usage = {0: "", 1: ""}, {}, None
    for chunk in srv.oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        assert chunk.id.startswith("cmpl-") and chunk.object == "text_completion"
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        for c in chunk.choices:
            assert c.index not in finish
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in full.choices}
    assert finish == {0: "length", 1: "length"}
    assert usage == full.usage
    # raw wire: data: {json}\n\n ... data: [DONE]\n\n; usage null on the other chunks
    r = httpx.post(srv.url + "/v1/completions", json={**{k: v for k, v in kw.items() if k != "extra_body"},
                                                      "ignore_eos": True, "stream": True,
                                                      "stream_options": {"include_usage": True}}, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _sse(r)
    assert all("usage" in e and e["usage"] is None for e in events[:-2])
    assert events[-2]["usage"]["completion_tokens"] == 30
    # MindIE's three counts only (prompt_tokens_details: ServerConfig.enablePromptTokensDetails)
    assert set(events[-2]["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    # without include_usage: no usage anywhere
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": True},
                   timeout=120)
    assert all("usage" not in e for e in _sse(r)[:-1])


def _boundary_stop(srv, ids: list[int]) -> tuple[str, int, str]:
    """(stop string spanning the boundary of tokens i and i+1, i, text before it)."""
    full = srv.tok.decode(ids)
    for i in range(2, len(ids) - 2):
        a = len(srv.tok.decode(ids[:i + 1]))
        prev = len(srv.tok.decode(ids[:i]))
        nxt = len(srv.tok.decode(ids[:i + 2]))
        if a - prev < 2 or nxt - a < 2:
            continue
        stop = full[a - 2:a + 2]
        if not (stop.isascii() and stop.isprintable()) or full.find(stop) != a - 2:
            continue
        if srv.tok.decode(ids[:i + 1]) != full[:a]:
            continue
        return stop, i, full[:a - 2]
    pytest.skip("no token boundary with an ASCII stop string in this output")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_split_across_tokens_never_leaks(srv, stream):
    ids = srv.tok.encode(PROMPT)
    greedy = _native(srv, ids, max_new_tokens=60, ignore_eos=True)
    stop, i, before = _boundary_stop(srv, greedy)
    kw = dict(model="demo", prompt=ids, max_tokens=60, temperature=0, stop=["never-there", stop],
              extra_body={"ignore_eos": True})
    if not stream:
        r = srv.oai.completions.create(**kw)
        c = r.choices[0]
        assert c.text == before and c.finish_reason == "stop"
        assert c.model_extra.get("stop_reason") == stop
        assert r.usage.completion_tokens == i + 2  # up to the token that completed the stop string
        inc = srv.oai.completions.create(**{**kw, "extra_body": {"ignore_eos": True,
                                                                 "include_stop_str_in_output": True}})
        assert inc.choices[0].text == before + stop
    else:
        text = ""
        for chunk in srv.oai.completions.create(stream=True, **kw):
            for c in chunk.choices:
                assert stop not in c.text
                text += c.text
                last = c.finish_reason
        assert text == before and last == "stop" and stop not in text
    chat = srv.oai.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=40, temperature=0,
                                           stop=stop, extra_body={"ignore_eos": True})
    assert stop not in chat.choices[0].message.content


def test_stop_token_ids(srv):
    ids = srv.tok.encode(PROMPT)
    sampled = _native(srv, ids, max_new_tokens=30, ignore_eos=True, temperature=1.0, do_sample=True, seed=21)
    k = next((i for i in range(2, len(sampled)) if sampled[i] not in sampled[:i]), None)
    if k is None:
        pytest.skip("no fresh token in the output")
    r = srv.oai.completions.create(model="demo", prompt=ids, max_tokens=30, temperature=1.0, seed=21,
                                   extra_body={"ignore_eos": True, "stop_token_ids": [sampled[k]]})
    c = r.choices[0]
    if c.finish_reason == "length":
        pytest.skip("the device workers do not honour stop_token_ids yet")
    assert c.finish_reason == "stop" and c.model_extra.get("stop_reason") == sampled[k]
    assert r.usage.completion_tokens == k + 1


# -- chat ---------------------------------------------------------------------------------------------
def test_chat_shape_usage_and_template(srv):
    r = srv.oai.chat.completions.create(model="demo", messages=MESSAGES, max_completion_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == "demo"
    [c] = r.choices
    assert c.message.role == "assistant" and c.finish_reason == "length" and c.logprobs is None
    prompt_ids = srv.tok.tokenizer.encode(srv.template.render(MESSAGES), add_special_tokens=False).ids
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == 8
    assert c.message.content == srv.tok.decode(_native(srv, prompt_ids, max_new_tokens=8, ignore_eos=True))
    # deprecated max_tokens still works (response_format constrains: tests/test_structured.py)
    r2 = srv.oai.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=8, temperature=0,
                                         response_format={"type": "text"}, extra_body={"ignore_eos": True})
    assert r2.choices[0].message.content == c.message.content


def test_chat_stream_order(srv):
    kw = dict(model="demo", messages=MESSAGES, max_completion_tokens=12, temperature=0.7, seed=11, n=2,
              extra_body={"ignore_eos": True})
    full = srv.oai.chat.completions.create(**kw)
    chunks = list(srv.oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert all(ch.object == "chat.completion.chunk" and ch.id.startswith("chatcmpl-") for ch in chunks)
    seen_role, content, finish = set(), {0: "", 1: ""}, {}
    for ch in chunks[:-1]:
        [c] = ch.choices
        if c.index not in seen_role:
            assert c.delta.role == "assistant" and not c.delta.content  # the role first
            seen_role.add(c.index)
            continue
        assert c.index not in finish
        content[c.index] += c.delta.content or ""
        if c.finish_reason:
            finish[c.index] = c.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert finish == {0: "length", 1: "length"}
    assert content == {c.index: c.message.content for c in full.choices}


def test_chat_template_kwargs_and_tools_accepted(srv):
    r = srv.oai.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=3, temperature=0,
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}],
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].finish_reason in ("stop", "length")


# -- logprobs -----------------------------------------------------------------------------------------
def _worker_logprobs(srv) -> None:
    r = srv.oai.completions.create(model="demo", prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1)
    if all(v is None for v in r.choices[0].logprobs.token_logprobs):
        pytest.skip("the device workers do not produce log-probabilities yet")


def test_completion_logprobs(srv):
    _worker_logprobs(srv)
    k = 5
    r = srv.oai.completions.create(model="demo", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=k,
                                   extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert math.isfinite(v) and v <= 0
        vals = list(top.values())
        assert k <= len(top) <= k + 1 and vals[:k] == sorted(vals[:k], reverse=True)
        assert top[tok] == v
        assert v == max(vals)  # greedy: the chosen token is the most likely
    # echo + logprobs: the prompt's tokens first, the first without a log-probability
    e = srv.oai.completions.create(model="demo", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0, echo=True,
                                   extra_body={"ignore_eos": True})
    elp = e.choices[0].logprobs
    n_prompt = len(srv.tok.encode(PROMPT))
    assert len(elp.tokens) == n_prompt + 3 and elp.token_logprobs[0] is None
    assert all(math.isfinite(v) and v <= 0 for v in elp.token_logprobs[1:])


def test_chat_logprobs(srv):
    _worker_logprobs(srv)
    k = 3
    r = srv.oai.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=8, temperature=0.8, seed=5,
                                        logprobs=True, top_logprobs=k, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 8
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert math.isfinite(c.logprob) and c.logprob <= 0 and bytes(c.bytes) == c.token.encode()
        vals = [t.logprob for t in c.top_logprobs]
        assert len(vals) == k and vals == sorted(vals, reverse=True) and all(v <= 0 for v in vals)
        for t in c.top_logprobs:
            if t.token == c.token:
                assert t.logprob == pytest.approx(c.logprob, abs=1e-6)
    # stream: the same log-probabilities
    streamed = []
    for ch in srv.oai.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=8, temperature=0.8, seed=5,
                                              logprobs=True, top_logprobs=k, stream=True,
                                              extra_body={"ignore_eos": True}):
        for c in ch.choices:
            if c.logprobs is not None:
                streamed += [x.logprob for x in c.logprobs.content]
    assert streamed == [c.logprob for c in content]


# -- benchmark fields (MINDIE_LLM_BENCHMARK_ENABLE=1 on this server) -------------------------------
def test_benchmark_fields(srv):
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 6,
                                                           "ignore_eos": True}, timeout=120)
    body = r.json()
    assert list(body)[-3:] == ["usage", "prefill_time", "decode_time_arr"]
    assert body["prefill_time"] > 0 and len(body["decode_time_arr"]) == 5
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True,
                                                      "stream": True}, timeout=120)
    events = _sse(r)
    last = events[-2]
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["prefill_time"] > 0 and len(last["decode_time_arr"]) == 5
    assert all("prefill_time" not in e for e in events[:-2])


# -- errors ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,param", [({"temperature": 2.5}, "temperature"), ({"logprobs": 21}, "logprobs"),
                                      ({"n": 0}, "n"), ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
                                      ({"presence_penalty": 3}, "presence_penalty"), ({"prompt": []}, "prompt"),
                                      ({"prompt": [1, "a"]}, "prompt"), ({"prompt": [99999999]}, "prompt")])
def test_completion_bad_params(srv, kw, param):
    body = {"model": "demo", "prompt": "hi", **kw}
    with pytest.raises(openai.BadRequestError) as ei:
        srv.oai.completions.create(**body)
    assert ei.value.status_code == 400
    err = httpx.post(srv.url + "/v1/completions", json=body, timeout=30).json()
    assert list(err) == ["error"] and list(err["error"]) == ["message", "type", "param", "code"]
    assert err["error"]["type"] == "BadRequestError" and err["error"]["code"] == 400
    assert err["error"]["param"] == param


def test_chat_bad_params(srv):
    for kw in ({"temperature": -1}, {"top_logprobs": 3}, {"logprobs": True, "top_logprobs": 21},
               {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, {"n": 0},
               {"messages": []}, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
               {"tool_choice": {"type": "function", "function": {"name": "g"}},
                "tools": [{"type": "function", "function": {"name": "f"}}]}):
        with pytest.raises(openai.BadRequestError):
            srv.oai.chat.completions.create(**{"model": "demo", "messages": MESSAGES, **kw})
    for raw in (b"{", b"[]", b"", b'{"messages": "x"}', b'{"messages": ' + b"[" * 200 + b"]" * 200 + b"}"):
        r = httpx.post(srv.url + "/v1/chat/completions", content=raw, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError", raw


def test_unknown_model_is_404(srv):
    with pytest.raises(openai.NotFoundError) as ei:
        srv.oai.chat.completions.create(model="nope", messages=MESSAGES)
    assert ei.value.body["message"] == "The model `nope` does not exist."
    assert ei.value.body["type"] == "NotFoundError" and ei.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        srv.oai.completions.create(model="nope", prompt="hi")
    # the placeholders TGI's clients send mean "the served model" (docs/apis.md)
    for name in ("tgi", "dummy"):
        r = srv.oai.chat.completions.create(model=name, messages=MESSAGES, max_completion_tokens=2)
        assert r.model == "demo" and r.usage.completion_tokens <= 2
        assert srv.oai.completions.create(model=name, prompt="hi", max_tokens=2).model == "demo"
    with pytest.raises(openai.NotFoundError):  # names are exact: a different case is another name
        srv.oai.chat.completions.create(model="TGI", messages=MESSAGES)


def test_req_id_header_echoed(srv):
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"req-id": "abc-1"},
                   timeout=30)
    assert r.status_code == 200 and r.headers["req-id"] == "abc-1"


def test_overload_is_503(srv):
    """maxLinkNum requests in progress: the next one is a 503 (the openai client raises
    InternalServerError for every 5xx)."""
    stop = threading.Event()
    started = []

    def long_stream():
        with httpx.stream("POST", srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1000,
                                                                      "ignore_eos": True, "stream": True},
                          timeout=120) as r:
            started.append(r.status_code)
            for _ in r.iter_bytes():
                if stop.is_set():
                    break

    threads = [threading.Thread(target=long_stream) for _ in range(MAX_LINK)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while len(started) < MAX_LINK and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started == [200] * MAX_LINK
        with pytest.raises(openai.InternalServerError) as ei:
            srv.oai.completions.create(model="demo", prompt="hi", max_tokens=2)
        assert ei.value.status_code == 503
        assert ei.value.body["type"] == "ServiceUnavailableError" and "maxLinkNum" in ei.value.body["message"]
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    # the slots come back
    deadline = time.monotonic() + 30
    while True:
        try:
            srv.oai.completions.create(model="demo", prompt="hi", max_tokens=2)
            break
        except openai.InternalServerError:
            assert time.monotonic() < deadline
            time.sleep(0.2)


# -- timeouts, client disconnects and /stopService (a server with e2eTimeout 3 s) -------------------
def test_timeout_disconnect_and_stop_service(tmp_path, demo_model):
    port = free_port()
    cfg = write_config(tmp_path / "config.json", port=port, run_dir=short_run_dir(), model_path=demo_model, workers=1,
                       server={"e2eTimeout": 3}, schedule={"maxIterTimes": 2000})
    srv = Server(cfg, port)
    try:
        srv.wait_ready(120)
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        long = dict(model="demo", prompt=PROMPT, max_tokens=2000, extra_body={"ignore_eos": True})

        def non_stream() -> tuple:
            t0 = time.monotonic()
            with pytest.raises(openai.InternalServerError) as ei:
                oai.completions.create(**long)
            return ei, time.monotonic() - t0

        def chat_stream() -> httpx.Response:
            return httpx.post(srv.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2000,
                                                                      "ignore_eos": True, "stream": True}, timeout=60)

        def completion_stream() -> None:
            with pytest.raises(openai.APIError):
                for _ in oai.completions.create(stream=True, **long):
                    pass

        # The three requests that run into the deadline run side by side: the worker decodes for
        # one e2eTimeout (a batch of three) instead of three in a row, each still timed out by
        # itself (the deadline is per request).
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            futs = [ex.submit(f) for f in (non_stream, chat_stream, completion_stream)]
            (ei, took), r, _ = [f.result(timeout=60) for f in futs]
        # non-stream: a 500 InternalServerError naming the deadline
        assert ei.value.status_code == 500 and took < 10, took
        assert ei.value.body["message"] == "Engine callback timeout: server e2eTimeout"
        assert ei.value.body["type"] == "InternalServerError"
        # stream: an error event, then [DONE]
        events = _sse(r)
        assert events[-2] == {"error": {"message": "Engine callback timeout: server e2eTimeout",
                                        "type": "InternalServerError", "param": None, "code": 500}}
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        # (the completions stream raised APIError: completion_stream)
        # a client that hangs up: its request ends at once (logged as 499), the server goes on
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json={**long, "ignore_eos": True, "n": 2}, timeout=0.5)
        # 499, not e2eTimeout's 500: a request that ran on would say 500 (the wait is not the proof)
        deadline = time.monotonic() + 10
        while "status=499" not in srv.tail(200) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "status=499" in srv.tail(200)
        # a stream whose client hangs up: the same
        with httpx.stream("POST", srv.url + "/v1/chat/completions",
                          json={"messages": MESSAGES, "max_tokens": 2000, "ignore_eos": True, "stream": True, "n": 2},
                          timeout=60) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
        deadline = time.monotonic() + 10
        while srv.tail(200).count("status=499") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.tail(200).count("status=499") == 2, srv.tail(20)
        # and the choices were cancelled on the worker: every slot is free again
        deadline = time.monotonic() + 2
        while True:
            slots = httpx.get(srv.url + "/v2/models/demo/getSlotCount", timeout=5).json()
            if slots["free_slots"] == slots["total_slots"]:
                break
            assert time.monotonic() < deadline, slots
            time.sleep(0.05)
        # /stopService: new OpenAI requests get 503 while it drains
        stream = threading.Thread(target=lambda: httpx.post(srv.url + "/v1/completions",
                                                            json={**long, "ignore_eos": True, "stream": True},
                                                            timeout=60))
        stream.start()
        deadline = time.monotonic() + 10  # until it runs: the drain below has it in flight
        while (slots := httpx.get(srv.url + "/v2/models/demo/getSlotCount", timeout=5).json())["free_slots"] == \
                slots["total_slots"]:
            assert time.monotonic() < deadline, slots
            time.sleep(0.02)
        stopper = threading.Thread(target=lambda: httpx.get(srv.url + "/stopService", timeout=60))
        stopper.start()
        # (the server exits once the stream ends, by e2eTimeout: 503 must come before that anyway)
        deadline = time.monotonic() + 10
        while httpx.get(srv.url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(openai.InternalServerError) as ei:
            oai.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=2)
        assert ei.value.status_code == 503
        assert ei.value.body == {"message": "The service has been stopped.", "type": "ServiceUnavailableError",
                                 "param": None, "code": 503}
        stream.join(30)
        stopper.join(30)
        srv.proc.wait(60)
        assert "Traceback" not in srv.tail(400)
    finally:
        srv.stop()
