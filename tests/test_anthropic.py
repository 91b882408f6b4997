"""Anthropic's Messages API (issue 54, item 1) through the ``anthropic`` package, on the real launch
script: the default model (SmolLM2-135M-Instruct, the session's shared server) for text, streams,
stop sequences, tools and structured output, each compared with the OpenAI chat route of the same
server for the same conversation; a tiny random DeepSeek-R1-style model (its prompt opens the think
block, so its answer is thinking) for ``thinking`` blocks. Errors as the SDK's own exceptions, in
Anthropic's shape; unknown ``/v1/...`` routes in OpenAI's (item 6)."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from mindie.contract import families
from mindie.contract.http_error import ApiError
from tests.harness import default_model_server, named_events, r1_server
from tests.lazy_modules import lazy_module

anthropic = lazy_module("anthropic")  # imported where a test uses it (tests/lazy_modules.py)
openai = lazy_module("openai")  # imported where a test uses it (tests/lazy_modules.py)

pytestmark = pytest.mark.timeout(600)

SYSTEM = "You are a helpful assistant. Answer in one sentence."
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOL = {"name": "get_weather", "description": "The weather of a city for some days", "input_schema": WEATHER}
GREEDY = {"temperature": 0}  # the SDK has no argument for it: an extra body field, as clients send it


def _clients(s):
    s.ant = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0, timeout=120)
    s.oai = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
    return s


@pytest.fixture(scope="module")
def smol(demo_servers):
    """The default model's shared server."""
    return _clients(default_model_server(demo_servers))


@pytest.fixture(scope="module")
def r1(tmp_path_factory):
    with r1_server(tmp_path_factory) as s:
        yield _clients(s)


def _text(msg) -> str:
    return "".join(b.text for b in msg.content if b.type == "text")


def _events(s, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a raw /v1/messages stream, checking each frame's name is its type."""
    return named_events(httpx.post(s.url + "/v1/messages", json={**body, "stream": True}, timeout=120))


def _check_order(events: list[tuple[str, dict]]) -> list[dict]:
    """Anthropic's order: message_start, ping, then per block start / deltas / stop (indices 0, 1,
    ...), message_delta, message_stop. Returns the blocks rebuilt from the deltas."""
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"], names
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    blocks: list[dict] = []
    open_ = None
    for name, data in events[2:-2]:
        if name == "content_block_start":
            assert open_ is None and data["index"] == len(blocks), names
            blocks.append(dict(data["content_block"]))
            open_ = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_, names
            d, b = data["delta"], blocks[open_]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json",
                   "signature_delta": "signature"}[d["type"]]
            b[key] = b.get(key, "") + d[key]
        else:
            assert name == "content_block_stop" and data["index"] == open_, names
            open_ = None
    assert open_ is None, names
    return blocks


def _conversation():
    """The same multi-turn conversation in both APIs' shapes (Anthropic's with text blocks)."""
    turns = [("user", "What is the capital of France?"), ("assistant", "The capital of France is Paris."),
             ("user", "And of Italy?")]
    ant = [{"role": r, "content": [{"type": "text", "text": t}]} for r, t in turns]
    oai = [{"role": "system", "content": SYSTEM}] + [{"role": r, "content": t} for r, t in turns]
    return ant, oai


def test_greedy_text_is_the_chat_routes(smol):
    """System prompt (as text blocks) and three turns: the greedy answer is the chat route's, token
    for token; the counts are its usage; count_tokens is the prompt the answer was given."""
    ant, oai = _conversation()
    msg = smol.ant.messages.create(model="SmolLM2-135M-Instruct", max_tokens=24, messages=ant,
                                   system=[{"type": "text", "text": SYSTEM}], metadata={"user_id": "u1"},
                                   extra_body=GREEDY)
    chat = smol.oai.chat.completions.create(model="SmolLM2-135M-Instruct", messages=oai, max_tokens=24, temperature=0)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.model == "SmolLM2-135M-Instruct" and [b.type for b in msg.content] == ["text"]
    assert _text(msg) == chat.choices[0].message.content and _text(msg)
    assert msg.usage.input_tokens == chat.usage.prompt_tokens
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    assert msg.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert msg.stop_sequence is None
    count = smol.ant.messages.count_tokens(model="SmolLM2-135M-Instruct", messages=ant, system=SYSTEM)
    assert count.input_tokens == msg.usage.input_tokens
    # a sampled answer follows top_k: top_k 1 is greedy whatever the temperature
    k1 = smol.ant.messages.create(model="SmolLM2-135M-Instruct", max_tokens=24, messages=ant, system=SYSTEM,
                                  extra_body={"temperature": 1.0, "top_k": 1, "top_p": 0.9})
    assert _text(k1) == _text(msg)


def test_stream_is_the_answer_in_anthropics_event_order(smol):
    ant, _ = _conversation()
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 20, "messages": ant, "system": SYSTEM}
    whole = smol.ant.messages.create(**body, extra_body=GREEDY)
    events = _events(smol, {**body, **GREEDY})
    blocks = _check_order(events)
    assert blocks == [{"type": "text", "text": _text(whole)}]
    assert sum(n == "content_block_delta" for n, _ in events) > 3  # piece by piece, not at the end
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": whole.stop_reason, "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens
    assert events[0][1]["message"]["usage"]["input_tokens"] == whole.usage.input_tokens
    # the SDK's own stream helper rebuilds the same message
    with smol.ant.messages.stream(**body, extra_body=GREEDY) as st:
        streamed = "".join(st.text_stream)
        final = st.get_final_message()
    assert streamed == _text(whole) == _text(final) and final.stop_reason == whole.stop_reason


def test_stop_sequences(smol):
    ant, oai = _conversation()
    kw = dict(model="SmolLM2-135M-Instruct", max_tokens=24, messages=ant, system=SYSTEM, extra_body=GREEDY)
    full = _text(smol.ant.messages.create(**kw))
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    msg = smol.ant.messages.create(stop_sequences=[stop, "never-written-xyz"], **kw)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop, msg
    assert _text(msg) == full[:full.index(stop)]
    chat = smol.oai.chat.completions.create(model="SmolLM2-135M-Instruct", messages=oai, max_tokens=24,
                                            temperature=0, stop=[stop])
    assert chat.choices[0].message.content == _text(msg)
    blocks = _check_order(_events(smol, {"model": "SmolLM2-135M-Instruct", "max_tokens": 24, "messages": ant,
                                          "system": SYSTEM, "stop_sequences": [stop], **GREEDY}))
    assert blocks == [{"type": "text", "text": _text(msg)}]


def test_forced_tool_then_its_result(smol):
    """tool_choice tool (and any): a tool_use block the grammar keeps to the schema, stop_reason
    tool_use, streamed as input_json_delta; then a tool_result turn answered as the chat route
    answers the same conversation with OpenAI's tool messages."""
    ask = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
    kw = dict(model="SmolLM2-135M-Instruct", max_tokens=80, messages=ask, tools=[TOOL], extra_body=GREEDY)
    # ("any" with parallel use off: with it on, the grammar admits call after call, and this small
    # model goes on to London and Rome until max_tokens)
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any", "disable_parallel_tool_use": True}):
        msg = smol.ant.messages.create(tool_choice=choice, **kw)
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == "tool_use" and len(uses) >= 1, msg
        assert len(uses) == len(msg.content), msg  # the grammar leaves no room for text: no markup shown
        use = uses[0]
        assert use.name == "get_weather" and use.id.startswith("toolu_") and len(use.id) > 10
        jsonschema.validate(use.input, WEATHER)
        with smol.ant.messages.stream(tool_choice=choice, **kw) as st:
            final = st.get_final_message()
        assert [(b.type, getattr(b, "input", None)) for b in final.content] == \
            [(b.type, getattr(b, "input", None)) for b in msg.content]
        assert final.stop_reason == "tool_use"
    raw = _events(smol, {"model": "SmolLM2-135M-Instruct", "max_tokens": 80, "messages": ask, "tools": [TOOL],
                         "tool_choice": {"type": "tool", "name": "get_weather"}, **GREEDY})
    blocks = _check_order(raw)
    assert blocks[-1]["type"] == "tool_use" and json.loads(blocks[-1]["partial_json"]) == use.input
    assert raw[-2][1]["delta"]["stop_reason"] == "tool_use"
    # the result goes back as a tool_result block; the chat route gets the same conversation
    result = json.dumps({"forecast": "sunny", "high_c": 24})
    turns = ask + [{"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                      "input": use.input}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                 "content": [{"type": "text", "text": result}]}]}]
    answer = smol.ant.messages.create(model="SmolLM2-135M-Instruct", max_tokens=30, messages=turns, tools=[TOOL],
                                      extra_body=GREEDY)
    oai = ask + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
                 {"role": "tool", "tool_call_id": use.id, "content": result}]
    chat = smol.oai.chat.completions.create(model="SmolLM2-135M-Instruct", messages=oai, max_tokens=30, temperature=0,
                                            tools=[{"type": "function", "function": {
                                                "name": TOOL["name"], "description": TOOL["description"],
                                                "parameters": WEATHER}}])
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert _text(answer) == (chat.choices[0].message.content or "")
    assert answer.stop_reason == ("tool_use" if chat.choices[0].message.tool_calls else
                                  {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason])
    count = smol.ant.messages.count_tokens(model="SmolLM2-135M-Instruct", messages=turns, tools=[TOOL])
    assert count.input_tokens == answer.usage.input_tokens


def test_output_config_json_schema(smol):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10**8}},
              "required": ["city", "population"], "additionalProperties": False}
    msg = smol.ant.messages.create(model="SmolLM2-135M-Instruct", max_tokens=60, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": "Name a big city and its population."}],
                                   output_config={"format": {"type": "json_schema", "schema": schema}})
    assert msg.stop_reason == "end_turn", msg
    jsonschema.validate(json.loads(_text(msg)), schema)


def test_errors_in_anthropics_shape(smol):
    ant = smol.ant
    ask = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.NotFoundError) as e:
        ant.messages.create(model="claude-nope", max_tokens=4, messages=ask)
    assert e.value.status_code == 404 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-nope" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        ant.messages.count_tokens(model="claude-nope", messages=ask)
    for bad in ({"temperature": 1.5}, {"top_k": -1}):  # Anthropic's ranges
        with pytest.raises(anthropic.BadRequestError) as e:
            ant.messages.create(model="SmolLM2-135M-Instruct", max_tokens=4, messages=ask, extra_body=bad)
        assert e.value.body["error"]["type"] == "invalid_request_error", e.value.body
        assert next(iter(bad)) in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:  # an image block: not for this model
        ant.messages.create(model="SmolLM2-135M-Instruct", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
    assert "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:  # a schema the grammar compiler refuses: named as sent
        ant.messages.create(model="SmolLM2-135M-Instruct", max_tokens=4, messages=ask,
                            output_config={"format": {"type": "json_schema", "schema": {"type": "objec"}}})
    said = e.value.body["error"]["message"]
    assert "output_config.format" in said and "response_format" not in said, said
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(model="SmolLM2-135M-Instruct", max_tokens=4, messages=ask, tools=[TOOL],
                            tool_choice={"type": "tool", "name": "nope"})
    assert "nope" in e.value.body["error"]["message"]
    for body in (b"{not json", b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}]}'):
        r = httpx.post(smol.url + "/v1/messages", content=body, timeout=30)  # no max_tokens: required
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and set(r.json()["error"]) == {"type", "message"}
    assert "max_tokens" in r.json()["error"]["message"]
    # a stream's error after it started: Anthropic's error event (what the pipeline and the coordinator write)
    frame = families.stream_error(families.ANTHROPIC, ApiError(503, "no device worker"))
    name, data = frame.decode().strip().split("\n")
    assert name == "event: error" and json.loads(data.removeprefix("data: ")) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "no device worker"}}


def test_unknown_v1_routes_answer_in_openai_shape(smol):
    """Item 6: unknown /v1/... paths in OpenAI's error shape (the openai package raises its
    NotFoundError), unknown paths under /v1/messages in Anthropic's, others in MindIE's."""
    r = httpx.post(smol.url + "/v1/no/such/route", json={}, timeout=10)
    assert r.status_code == 404 and r.json() == {"error": {"message": "Invalid URL (POST /v1/no/such/route)",
                                                           "type": "NotFoundError", "param": None, "code": 404}}
    with pytest.raises(openai.NotFoundError) as e:  # the openai package reads the message out of it
        smol.oai.post("/no_such_route", cast_to=object, body={})
    assert e.value.body["type"] == "NotFoundError" and "/v1/no_such_route" in e.value.message
    r = httpx.post(smol.url + "/v1/messages/batches", json={}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(smol.url + "/no/such/route", timeout=10)
    assert r.status_code == 404 and set(r.json()) == {"error", "error_type"}


def test_thinking_blocks(r1):
    """The reasoning parser's output as a thinking block (with a signature) before the text: the
    chat route's reasoning_content, streamed as thinking_delta then signature_delta."""
    ask = [{"role": "user", "content": "What is 2+2?"}]
    chat = r1.oai.chat.completions.create(model="tiny-r1", messages=ask, max_tokens=12, temperature=0).model_dump()
    reasoning = chat["choices"][0]["message"]["reasoning_content"]
    assert reasoning, chat  # the prompt opens the think block: the random model's text is thinking
    msg = r1.ant.messages.create(model="tiny-r1", max_tokens=12, messages=ask, extra_body=GREEDY)
    assert msg.content[0].type == "thinking" and msg.content[0].thinking == reasoning
    assert isinstance(msg.content[0].signature, str) and msg.content[0].signature
    assert _text(msg) == (chat["choices"][0]["message"]["content"] or "")
    blocks = _check_order(_events(r1, {"model": "tiny-r1", "max_tokens": 12, "messages": ask, **GREEDY}))
    assert blocks[0] == {"type": "thinking", "thinking": reasoning, "signature": msg.content[0].signature}
    with r1.ant.messages.stream(model="tiny-r1", max_tokens=12, messages=ask, extra_body=GREEDY) as st:
        final = st.get_final_message()
    assert [b.model_dump(exclude_none=True) for b in final.content] == \
        [b.model_dump(exclude_none=True) for b in msg.content]
