"""TGI on the real launch script (issue 14): ``POST /generate``, ``/generate_stream`` and ``/``
driven by the real clients (``huggingface_hub.InferenceClient.text_generation`` and, when it is
installed, the older ``text-generation`` package), plus raw bodies for the frames and MindIE's
errors (mindie.md §2.1, §7; tgi.md §4)."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.harness import demo_server

pytestmark = pytest.mark.timeout(600)

PROMPT = "Hello world, tell me a story"


@pytest.fixture(scope="module")
def srv(tmp_path_factory, demo_model):
    with demo_server(tmp_path_factory.mktemp("tgi"), demo_model, schedule={"maxIterTimes": 2000}) as s:
        yield s


def post(srv, path: str, body, **kw) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60, **kw)


def sse(text: str) -> list[dict]:
    """The events of a TGI stream (``data:{json}`` blocks)."""
    out = []
    for block in text.split("\n\n"):
        if block.strip():
            assert block.startswith("data:"), block
            out.append(json.loads(block[5:]))
    return out


def greedy_tokens(srv, n: int = 8) -> list[dict]:
    r = post(srv, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": n, "details": True,
                                                                 "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["details"]["tokens"]


# -- huggingface_hub.InferenceClient ------------------------------------------------------------

@pytest.fixture(scope="module")
def hub(srv):
    hf = pytest.importorskip("huggingface_hub")
    return hf.InferenceClient(base_url=srv.url, timeout=60)


def test_hub_text_generation_plain_and_details(hub, srv):
    text = hub.text_generation(PROMPT, max_new_tokens=6)
    assert isinstance(text, str) and text
    out = hub.text_generation(PROMPT, max_new_tokens=6, details=True, decoder_input_details=True, seed=7)
    d = out.details
    assert out.generated_text == text  # greedy: the same text
    assert d.finish_reason in ("length", "eos_token")
    assert d.generated_tokens == len(d.tokens) <= 6
    assert d.seed == 7
    # real log-probabilities: negative numbers, one per generated token
    assert all(t.logprob is not None and t.logprob <= 0.0 for t in d.tokens)
    assert "".join(t.text for t in d.tokens if not t.special) == out.generated_text
    # prefill: the prompt's tokens, the first without a logprob, the others with one
    assert d.prefill and d.prefill[0].logprob is None
    assert all(t.logprob is not None and t.logprob <= 0.0 for t in d.prefill[1:])
    assert all(t.text is not None for t in d.prefill)


def test_hub_stream_matches_non_stream(hub):
    full = hub.text_generation(PROMPT, max_new_tokens=6, details=True)
    events = list(hub.text_generation(PROMPT, max_new_tokens=6, stream=True, details=True))
    assert [e.index for e in events] == list(range(1, len(events) + 1))
    assert [e.token.id for e in events] == [t.id for t in full.details.tokens]
    assert all(e.generated_text is None and e.details is None for e in events[:-1])
    last = events[-1]
    assert last.generated_text == full.generated_text == "".join(e.token.text for e in events)
    assert last.details.finish_reason == full.details.finish_reason
    assert last.details.generated_tokens == len(events)
    assert [e.token.logprob for e in events] == pytest.approx([t.logprob for t in full.details.tokens])


def test_hub_stream_text_only(hub):
    pieces = list(hub.text_generation(PROMPT, max_new_tokens=5, stream=True))
    assert all(isinstance(p, str) for p in pieces)
    assert "".join(pieces) == hub.text_generation(PROMPT, max_new_tokens=5)


def test_hub_stop_split_across_tokens_never_leaks(hub, srv):
    toks = [t["text"] for t in greedy_tokens(srv)]
    text = "".join(toks)
    # a stop string made of the end of token 1 and the start of token 2, first seen there
    cut = len(toks[0])
    stop = text[cut - 1:cut + 1]
    assert len(stop) == 2 and text.find(stop) == cut - 1, (toks, stop)
    out = hub.text_generation(PROMPT, max_new_tokens=8, stop=[stop], details=True)
    assert out.generated_text == text[:cut - 1]
    assert out.details.finish_reason == "stop_sequence"
    events = list(hub.text_generation(PROMPT, max_new_tokens=8, stop=[stop], stream=True, details=True))
    streamed = "".join(e.token.text for e in events)
    assert streamed == text[:cut - 1] and stop not in streamed
    assert events[-1].details.finish_reason == "stop_sequence"
    assert events[-1].generated_text == text[:cut - 1]


def test_hub_return_full_text_and_seeded_sampling(hub):
    out = hub.text_generation(PROMPT, max_new_tokens=4, return_full_text=True)
    assert out.startswith(PROMPT)
    a = hub.text_generation(PROMPT, max_new_tokens=8, do_sample=True, temperature=0.9, top_k=50, seed=1234,
                            details=True)
    b = hub.text_generation(PROMPT, max_new_tokens=8, do_sample=True, temperature=0.9, top_k=50, seed=1234,
                            details=True)
    assert [t.id for t in a.details.tokens] == [t.id for t in b.details.tokens]
    assert a.details.seed == 1234


# -- huggingface_hub.InferenceClient.chat_completion (the OpenAI route, as TGI serves it) ------------

MESSAGES = [{"role": "user", "content": "Hello, who are you?"}]


@pytest.mark.parametrize("model", [None, "demo"])
def test_hub_chat_completion(hub, srv, model):
    """Without a model the client sends its placeholder ("dummy"): accepted as TGI accepts it.
    Greedy, so the answer is the OpenAI route's with the served name."""
    kw = {} if model is None else {"model": model}
    out = hub.chat_completion(MESSAGES, max_tokens=6, temperature=0, **kw)
    want = post(srv, "/v1/chat/completions", {"model": "demo", "messages": MESSAGES, "max_tokens": 6,
                                              "temperature": 0}).json()
    assert out.model == "demo"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == want["choices"][0]["message"]["content"]
    assert out.choices[0].finish_reason == want["choices"][0]["finish_reason"]
    assert out.usage.completion_tokens == want["usage"]["completion_tokens"] <= 6
    # the OpenAI-style alias of the same call
    alias = hub.chat.completions.create(messages=MESSAGES, max_tokens=6, temperature=0, **kw)
    assert alias.choices[0].message.content == out.choices[0].message.content
    # the URL given as the client's model (the InferenceClient(url)) is the same client
    hf = pytest.importorskip("huggingface_hub")
    positional = hf.InferenceClient(srv.url, timeout=60).chat_completion(MESSAGES, max_tokens=6, temperature=0, **kw)
    assert positional.choices[0].message.content == out.choices[0].message.content


@pytest.mark.parametrize("model", [None, "demo"])
def test_hub_chat_completion_stream(hub, model):
    kw = {} if model is None else {"model": model}
    full = hub.chat_completion(MESSAGES, max_tokens=6, temperature=0, **kw)
    chunks = list(hub.chat_completion(MESSAGES, max_tokens=6, temperature=0, stream=True,
                                      stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finished = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finished == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.model == "demo" for c in chunks)


def test_hub_chat_completion_wrong_model_is_404(hub):
    hf = pytest.importorskip("huggingface_hub")
    with pytest.raises(hf.errors.HfHubHTTPError) as e:
        hub.chat_completion(MESSAGES, model="no-such-model", max_tokens=2)
    assert e.value.response.status_code == 404
    assert "The model `no-such-model` does not exist." in str(e.value)


def test_hub_errors(hub):
    hf = pytest.importorskip("huggingface_hub")
    with pytest.raises(hf.errors.TextGenerationError) as e:  # top_p 1.0: refused as on /infer
        hub.text_generation(PROMPT, max_new_tokens=3, top_p=1.0)
    assert "Parameter top_p must be in (0.0,1.0], got 1.0." in str(e.value)


# -- the older text-generation client (POST / ) ---------------------------------------------------

def test_text_generation_client(srv):
    # Not in the [test] extras: text-generation 0.7.0 (its last release) requires
    # huggingface_hub<1.0 and aiohttp, and would downgrade the huggingface_hub the other tests use.
    tg = pytest.importorskip("text_generation", reason="the text-generation package is not installed (it pins "
                                                       "huggingface_hub<1.0; docs/apis.md)")
    c = tg.Client(srv.url, timeout=60)
    r = c.generate(PROMPT, max_new_tokens=5, decoder_input_details=True)
    assert r.details.generated_tokens == len(r.details.tokens) <= 5
    assert r.details.finish_reason.value in ("length", "eos_token")
    assert all(t.logprob is not None for t in r.details.tokens)
    assert r.details.prefill[0].logprob is None and r.details.prefill[0].id == r.details.prefill[0].id
    events = list(c.generate_stream(PROMPT, max_new_tokens=5))
    assert "".join(e.token.text for e in events) == r.generated_text == events[-1].generated_text
    assert events[-1].details.generated_tokens == len(events)
    with pytest.raises(tg.errors.UnknownError, match="top_k"):
        c.generate(PROMPT, max_new_tokens=2, top_k=2**31)


# -- raw bodies: frames, routes and MindIE's errors ---------------------------------------------

def test_stream_frames_exact(srv):
    r = post(srv, "/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": 3, "ignore_eos": True,
                                                                         "details": True, "seed": 5}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.startswith("data:{\"index\":1,\"token\":{\"id\":")
    ev = sse(r.text)
    assert [list(e) for e in ev] == [["index", "token", "generated_text", "details"]] * 3
    assert [list(e["token"]) for e in ev] == [["id", "text", "logprob", "special"]] * 3
    assert ev[-1]["details"] == {"prompt_tokens": ev[-1]["details"]["input_length"], "finish_reason": "length",
                                 "generated_tokens": 3, "seed": 5, "input_length": ev[-1]["details"]["input_length"]}
    assert r.headers["req-id"]


def test_compat_route(srv):
    r = post(srv, "/", {"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
    assert r.status_code == 200
    body = r.json()
    assert isinstance(body, list) and list(body[0]) == ["generated_text"]
    r = post(srv, "/", {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 2}})
    assert r.headers["content-type"].startswith("text/event-stream")
    assert sse(r.text)[-1]["generated_text"] == body[0]["generated_text"][:len(sse(r.text)[-1]["generated_text"])]


def test_top_n_tokens(srv):
    r = post(srv, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 3, "details": True,
                                                                 "top_n_tokens": 2}})
    d = r.json()["details"]
    assert len(d["top_tokens"]) == 3 and all(len(t) == 2 for t in d["top_tokens"])
    assert [t[0]["id"] for t in d["top_tokens"]] == [t["id"] for t in d["tokens"]]  # greedy: the best one


def test_truncate_keeps_the_last_tokens(srv):
    r = post(srv, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 1, "truncate": 2,
                                                                 "decoder_input_details": True}})
    assert r.status_code == 200, r.text
    d = r.json()["details"]
    assert d["prompt_tokens"] == 2 and len(d["prefill"]) == 2


def _running(srv) -> int:
    return httpx.get(srv.url + "/v1/status", timeout=10).json()["resource"]["runningRequestNum"]


def _token_s(srv) -> float:
    """A token's time here now (a loaded machine makes tokens slow)."""
    t0 = time.monotonic()
    r = post(srv, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 100, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return (time.monotonic() - t0) / 100


def _wait_idle(srv, what: str, token_s: float) -> None:
    # 2000 tokens take several seconds: only a cancel ends it this soon (2 s, or 500 tokens' time)
    end = time.monotonic() + max(2.0, 500 * token_s)
    while _running(srv):
        assert time.monotonic() < end, f"{what}: still running on the worker"
        time.sleep(0.05)


@pytest.mark.parametrize("path", ["/generate_stream", "/generate"])
def test_client_that_hangs_up_is_cancelled(srv, path):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2000, "ignore_eos": True}}
    token_s = _token_s(srv)
    with httpx.Client(timeout=60) as c:
        try:
            with c.stream("POST", srv.url + path, json=body, headers={"req-id": f"gone{len(path)}"},
                          timeout=0.5) as r:
                for _ in r.iter_raw():
                    break  # first event, then hang up
        except httpx.ReadTimeout:
            pass  # non-stream: nothing comes before the end
    _wait_idle(srv, path, token_s)
    srv.log.flush()
    end = time.monotonic() + 5
    while f"request gone{len(path)} {path} status=499" not in srv.log_path.read_text():
        assert time.monotonic() < end, srv.tail()
        time.sleep(0.05)


def test_info_on_the_business_plane(srv):
    r = httpx.get(srv.url + "/info", timeout=10)
    assert r.status_code == 200 and r.json()["models"][0]["model_id"] == "demo"


ERRORS = [
    ("/generate", {"x": 1}, 422, '{"Error": "`inputs` or `prompt` must be necessary and data type must be string. '
                                 'Additionally, the request body must be valid json", "error_type": "validation"}'),
    ("/generate_stream", {"x": 1}, 422, "Request should contain 'inputs' and the type should be string."),
    ("/generate", {"inputs": ""}, 422, "Inputs length must be in (0, 41943040], but got 0"),
    ("/generate", {"inputs": 5}, 422, "The type of inputs is abnormal"),
    ("/generate", {"inputs": "a", "parameters": 3}, 422, "parameters must be object type."),
    ("/generate", {"inputs": "a", "parameters": {"stop": 3}}, 422,
     "Input validation error: param stop must be string or list[string]"),
    ("/generate", {"inputs": "a", "parameters": {"stop": ["a", ""]}}, 422,
     "Input validation error: `stop` must be list[string] if list, and item length in [1, 1024] with total <= 32768"),
    ("/generate", {"inputs": "a", "parameters": {"stop": "x" * 1025}}, 422,
     "Input validation error: length of `stop` must be in [1, 1024], but got 1025"),
    ("/generate", {"inputs": "a", "parameters": {"temperature": 0}}, 422,
     "Parameter temperature must be in (0.0,3.40282e+38], got 0."),
    ("/generate", {"inputs": "a", "parameters": {"top_k": 0}}, 422,
     "Parameter top_k must be in -1 || (0,2147483647], got 0"),
    ("/generate", {"inputs": "a", "parameters": {"top_p": 1.0}}, 422, "Parameter top_p must be in (0.0,1.0], got 1.0."),
    ("/generate", {"inputs": "a", "parameters": {"do_sample": 1}}, 422, "do_sample must be boolean type."),
    ("/generate", {"inputs": "a", "parameters": {"seed": -1}}, 422, "seed must be unsigned type."),
    ("/generate", {"inputs": "a", "parameters": {"max_new_tokens": 0}}, 422,
     "Parameter max_new_tokens must be in (0,2147483647], got 0."),
    ("/generate", {"inputs": "a", "parameters": {"truncate": 0}}, 422, "truncate must be in (0,2147483647], got 0."),
    ("/generate", {"inputs": "a", "parameters": {"adapter_id": "a b"}}, 422, "The format of adapter_id is invalid."),
    ("/generate", {"inputs": "a", "parameters": {"adapter_id": "lora1"}}, 404, "Model lora1 not found."),
    ("/generate", {"inputs": "a", "parameters": {"best_of": 2}}, 422,
     "best_of/n greater than 1 are not supported by this endpoint"),
    ("/generate", {"inputs": "a", "parameters": {"top_n_tokens": 6}}, 422,
     "Parameter top_n_tokens must be in [0, 5], got 6."),
    ("/generate_stream", {"inputs": "a", "parameters": {"decoder_input_details": True}}, 422,
     "The decoder_input_details must not be true when stream is true."),
    ("/", {"inputs": "a", "stream": "yes"}, 422, "Stream must be boolean type."),
    ("/generate", {"inputs": "a " * 3000}, 424,
     "Failed to enqueue inferRequest. This model's maximum input ids length cannot be greater than 2048,"
     "the input ids length is "),
]


@pytest.mark.parametrize("path,body,status,message", ERRORS)
def test_errors(srv, path, body, status, message):
    r = post(srv, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err.startswith(message) if status == 424 else err == message
    assert list(r.json()) == ["error", "error_type"]


def test_bad_json(srv):
    for path, msg in [("/", "Failed to parse context to json body"),
                      ("/generate_stream", "Failed to parse request context to json")]:
        r = httpx.post(srv.url + path, content=b"{nope", timeout=10)
        assert r.status_code == 422 and r.json() == {"error": msg, "error_type": "Input Validation Error"}
