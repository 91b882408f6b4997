"""OpenAI's Responses API (issue 54, item 2) through the ``openai`` package, on the real launch
script: the default model (SmolLM2-135M-Instruct, the session's shared server) for text, streams,
structured output, function tools and the store, each compared with the chat route of the same
server for the same conversation; a tiny random DeepSeek-R1-style model (its prompt opens the
think block) for ``reasoning`` items. The store module itself across two instances (what two
front ends, or a restarted server, see). Errors as the SDK's own exceptions."""
from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import jsonschema
import pydantic
import pytest

from mindie.contract import families
from mindie.contract.http_error import ApiError
from mindie.server.response_store import ResponseStore, new_id
from tests.harness import DEFAULT_MODEL, default_model_server, demo_server, named_events, r1_server
from tests.lazy_modules import lazy_module

openai = lazy_module("openai")  # imported where a test uses it (tests/lazy_modules.py)

pytestmark = pytest.mark.timeout(600)

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are a helpful assistant. Answer in one sentence."
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather of a city for some days",
        "parameters": WEATHER, "strict": True}


def _with_client(s):
    """``s`` with ``s.oai``, an openai client of it (no retries: an error is the server's)."""
    s.oai = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
    return s


@pytest.fixture(scope="module")
def smol(demo_servers):
    return _with_client(default_model_server(demo_servers))


@pytest.fixture(scope="module")
def r1(tmp_path_factory):
    with r1_server(tmp_path_factory) as s:
        yield _with_client(s)


def _conversation():
    """The same conversation as Responses input items and as chat messages."""
    turns = [("user", "What is the capital of France?"), ("assistant", "The capital of France is Paris."),
             ("user", "And of Italy?")]
    items = [{"role": r, "content": [{"type": "input_text" if r == "user" else "output_text", "text": t}]}
             for r, t in turns]
    chat = [{"role": "system", "content": SYSTEM}] + [{"role": r, "content": t} for r, t in turns]
    return items, chat


def _events(s, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a raw /v1/responses stream, checking each frame's name is its type and
    the sequence numbers count from 0."""
    out = named_events(httpx.post(s.url + "/v1/responses", json={**body, "stream": True}, timeout=120))
    assert [data["sequence_number"] for _, data in out] == list(range(len(out))), out
    return out


def _check_order(events: list[tuple[str, dict]]) -> list[dict]:
    """created, in_progress, per item added / deltas / done, completed|incomplete; returns the items
    rebuilt from the deltas, checked against each item's done event."""
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"], names
    assert names[-1] in ("response.completed", "response.incomplete"), names
    items: list[dict] = []
    text = ""
    for name, data in events[2:-1]:
        if name == "response.output_item.added":
            assert data["output_index"] == len(items), names
            items.append(dict(data["item"]))
            text = ""
        elif name.endswith(".delta"):
            assert data["item_id"] == items[-1]["id"] and data["output_index"] == len(items) - 1, names
            text += data["delta"]
        elif name == "response.output_item.done":
            item = data["item"]
            assert item["id"] == items[-1]["id"], names
            got = {"message": lambda: item["content"][0]["text"], "function_call": lambda: item["arguments"],
                   "reasoning": lambda: item["summary"][0]["text"]}[item["type"]]()
            assert got == text, (item, text)
            items[-1] = item
    final = events[-1][1]["response"]
    assert final["output"] == items, (final, items)
    return items


def test_greedy_text_is_the_chat_routes(smol):
    """Instructions and three turns (input_text / output_text parts): the greedy answer is the chat
    route's, token for token; usage is its usage; the object has the SDK's fields."""
    items, chat_msgs = _conversation()
    resp = smol.oai.responses.create(model=MODEL, instructions=SYSTEM, input=items, max_output_tokens=24,
                                     temperature=0, metadata={"k": "v"}, store=False)
    chat = smol.oai.chat.completions.create(model=MODEL, messages=chat_msgs, max_tokens=24, temperature=0)
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == MODEL
    assert resp.output_text == chat.choices[0].message.content and resp.output_text
    [msg] = resp.output
    assert msg.type == "message" and msg.id.startswith("msg_") and msg.role == "assistant"
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.total_tokens == chat.usage.total_tokens
    finish = chat.choices[0].finish_reason
    assert resp.status == {"stop": "completed", "length": "incomplete"}[finish] and msg.status == resp.status
    assert resp.instructions == SYSTEM and resp.metadata == {"k": "v"} and resp.temperature == 0
    assert resp.max_output_tokens == 24 and resp.store is False and resp.tools == []
    # a string input is one user turn
    one = smol.oai.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=16,
                                    temperature=0, store=False)
    chat1 = smol.oai.chat.completions.create(model=MODEL, max_tokens=16, temperature=0, messages=[
        {"role": "user", "content": "What is the capital of France?"}])
    assert one.output_text == chat1.choices[0].message.content


def test_stream_is_the_answer_in_event_order(smol):
    items, _ = _conversation()
    body = {"model": MODEL, "instructions": SYSTEM, "input": items, "max_output_tokens": 20, "temperature": 0,
            "store": False}
    whole = smol.oai.responses.create(**body)
    events = _events(smol, body)
    got = _check_order(events)
    assert [i["type"] for i in got] == ["message"] and got[0]["content"][0]["text"] == whole.output_text
    assert sum(n == "response.output_text.delta" for n, _ in events) > 3  # piece by piece
    names = [n for n, _ in events]
    assert names[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert names[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    final = events[-1][1]["response"]
    assert final["usage"]["output_tokens"] == whole.usage.output_tokens
    assert final["usage"]["input_tokens"] == whole.usage.input_tokens
    assert names[-1] == ("response.completed" if whole.status == "completed" else "response.incomplete")
    # the SDK's stream helper rebuilds the same response
    with smol.oai.responses.stream(**body) as st:
        deltas = "".join(e.delta for e in st if e.type == "response.output_text.delta")
        final = st.get_final_response()
    assert deltas == whole.output_text == final.output_text


def test_max_output_tokens_is_incomplete(smol):
    resp = smol.oai.responses.create(model=MODEL, input="Write a long story about a dragon.", max_output_tokens=5,
                                     temperature=0, store=False)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 5 and resp.output[0].status == "incomplete"
    events = _events(smol, {"model": MODEL, "input": "Write a long story about a dragon.", "max_output_tokens": 5,
                            "temperature": 0, "store": False})
    _check_order(events)
    assert events[-1][0] == "response.incomplete"
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


class City(pydantic.BaseModel):
    city: str
    population: int


def test_parse_gives_the_pydantic_object(smol):
    """``responses.parse(text_format=Model)``: the SDK's json_schema format through structured output."""
    resp = smol.oai.responses.parse(model=MODEL, input="Name a big city and its population.", text_format=City,
                                    max_output_tokens=60, temperature=0, store=False)
    assert resp.status == "completed", resp
    parsed = resp.output_parsed
    assert isinstance(parsed, City) and parsed == City.model_validate_json(resp.output_text)
    assert resp.text.format.type == "json_schema"
    obj = smol.oai.responses.create(model=MODEL, input="Describe Paris in JSON.", max_output_tokens=40,
                                    temperature=0, text={"format": {"type": "json_object"}}, store=False)
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


def test_forced_function_then_its_output_with_previous_response_id(smol):
    """A forced function tool: a function_call item the grammar keeps to the schema (streamed as
    arguments deltas too); then function_call_output continuing it by previous_response_id is the
    chat route's answer to the same conversation."""
    ask = "What is the weather in Paris for the next 3 days?"
    for choice in ({"type": "function", "name": "get_weather"}, "required"):
        resp = smol.oai.responses.create(model=MODEL, input=ask, tools=[TOOL], tool_choice=choice,
                                         max_output_tokens=80, temperature=0)
        calls = [o for o in resp.output if o.type == "function_call"]
        assert len(calls) >= 1 and len(calls) == len(resp.output), resp  # no markup left as text
        call = calls[0]
        assert call.name == "get_weather" and call.id.startswith("fc_") and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER)
        assert resp.tools[0].name == "get_weather"
    events = _events(smol, {"model": MODEL, "input": ask, "tools": [TOOL], "temperature": 0, "store": False,
                            "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 80})
    got = _check_order(events)
    assert got[0]["type"] == "function_call" and json.loads(got[0]["arguments"]) == json.loads(call.arguments)
    assert "response.function_call_arguments.done" in [n for n, _ in events]
    result = json.dumps({"forecast": "sunny", "high_c": 24})
    follow = smol.oai.responses.create(model=MODEL, previous_response_id=resp.id, tools=[TOOL], temperature=0,
                                       max_output_tokens=30, input=[{"type": "function_call_output",
                                                                     "call_id": call.call_id, "output": result}])
    assert follow.previous_response_id == resp.id
    chat = smol.oai.chat.completions.create(model=MODEL, max_tokens=30, temperature=0, messages=[
        {"role": "user", "content": ask},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result}],
        tools=[{"type": "function", "function": {"name": TOOL["name"], "description": TOOL["description"],
                                                 "parameters": WEATHER, "strict": True}}])
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    assert follow.output_text == (chat.choices[0].message.content or "")


def test_store_get_delete_and_another_process_sees_it(smol):
    """store (default true): GET returns the response, previous_response_id continues it as the chat
    route answers the whole conversation, DELETE removes it (then 404); the file is in the run
    directory's responses/, where another ResponseStore (another front end, a restarted server) finds it."""
    first = smol.oai.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=16,
                                      temperature=0)
    got = smol.oai.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()
    config = json.loads((smol.log_path.parent / "config.json").read_text())
    other = ResponseStore(os.path.join(config["ServerConfig"]["runDir"], "responses"))
    assert other.get(first.id)["response"]["output"][0]["content"][0]["text"] == first.output_text
    second = smol.oai.responses.create(model=MODEL, input="And of Italy?", previous_response_id=first.id,
                                       max_output_tokens=16, temperature=0)
    chat = smol.oai.chat.completions.create(model=MODEL, max_tokens=16, temperature=0, messages=[
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And of Italy?"}])
    assert second.output_text == chat.choices[0].message.content
    smol.oai.responses.delete(first.id)
    r = httpx.delete(f"{smol.url}/v1/responses/{first.id}", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError", r.text
    with pytest.raises(openai.NotFoundError):
        smol.oai.responses.retrieve(first.id)
    assert other.get(first.id) is None
    with pytest.raises(openai.NotFoundError) as e:  # its continuation is gone with it
        smol.oai.responses.create(model=MODEL, input="x", previous_response_id=first.id, max_output_tokens=4)
    assert e.value.body["param"] == "previous_response_id"
    # store false keeps nothing
    gone = smol.oai.responses.create(model=MODEL, input="hi", max_output_tokens=4, temperature=0, store=False)
    with pytest.raises(openai.NotFoundError):
        smol.oai.responses.retrieve(gone.id)


def test_store_module_across_instances(tmp_path):
    """Two ResponseStores on one directory (two front ends; a server before and after a restart):
    what one writes the other reads and deletes; ids that are not ids are never paths; the oldest
    go past max_count; a write is atomic (no temporary file left)."""
    a, b = ResponseStore(str(tmp_path / "r")), ResponseStore(str(tmp_path / "r"), max_count=3)
    ids = [new_id() for _ in range(5)]
    for i, rid in enumerate(ids):
        a.put(rid, {"response": {"id": rid, "n": i}, "input": []})
        os.utime(tmp_path / "r" / f"{rid}.json", ns=(i * 10**9, i * 10**9))
    assert b.get(ids[2]) == {"response": {"id": ids[2], "n": 2}, "input": []}
    assert sorted(b.prune()) == sorted(ids[:2]) and a.get(ids[0]) is None and a.get(ids[4]) is not None
    assert b.delete(ids[4]) and not a.delete(ids[4]) and a.get(ids[4]) is None
    (tmp_path / "secret.json").write_text('{"response": 1}')
    for bad in ("../secret", "resp_../../secret", "resp_a/b", "", "resp_" + "x" * 65, "secret"):
        assert a.get(bad) is None and not a.delete(bad)
        with pytest.raises(ValueError):
            a.put(bad, {})
    assert (tmp_path / "secret.json").exists()
    assert sorted(p.suffix for p in (tmp_path / "r").iterdir()) == [".json", ".json"]


def test_errors_raise_the_sdks_exceptions(smol):
    oai = smol.oai
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model="gpt-nope", input="hi", max_output_tokens=4)
    assert "gpt-nope" in e.value.body["message"] and e.value.body["code"] == 404
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve("resp_doesnotexist")
    r = httpx.get(f"{smol.url}/v1/responses/..%2F..%2Fetc", timeout=10)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    for bad, word in (({"temperature": 3}, "temperature"), ({"tools": [{"type": "web_search"}]}, "web_search"),
                      ({"input": [{"type": "input_image", "image_url": "http://x/y.png"}]}, "input_image"),
                      ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                       "input_image"),
                      ({"text": {"format": {"type": "yaml"}}}, "yaml")):
        with pytest.raises(openai.BadRequestError) as e:
            oai.responses.create(**{"model": MODEL, "input": "hi", "max_output_tokens": 4, **bad})
        assert word in e.value.body["message"], e.value.body
    with pytest.raises(openai.BadRequestError) as e:  # a schema the grammar compiler refuses: named as sent
        oai.responses.create(model=MODEL, input="hi", max_output_tokens=4, text={"format": {
            "type": "json_schema", "name": "x", "schema": {"type": "objec"}}})
    assert "text.format" in e.value.body["message"] and e.value.body["param"] == "text.format", e.value.body
    assert "response_format" not in e.value.body["message"], e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input="hi", tools=[TOOL], tool_choice={"type": "function", "name": "nope"})
    assert "nope" in e.value.body["message"]
    r = httpx.post(smol.url + "/v1/responses", content=b"{not json", timeout=30)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    r = httpx.put(smol.url + "/v1/responses", json={}, timeout=30)
    assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    # a stream's error after it started: the error event (what the pipeline and the coordinator write)
    frame = families.stream_error(families.RESPONSES, ApiError(503, "no device worker"))
    name, data = frame.decode().strip().split("\n")
    assert name == "event: error" and json.loads(data.removeprefix("data: ")) == {
        "type": "error", "code": "ServiceUnavailableError", "message": "no device worker", "param": None,
        "sequence_number": 0}


def test_reasoning_item(r1):
    """The reasoning parser's output as a reasoning item (summary text) before the message: the chat
    route's reasoning_content, streamed as reasoning_summary_text deltas."""
    ask = "What is 2+2?"
    chat = r1.oai.chat.completions.create(model="tiny-r1", messages=[{"role": "user", "content": ask}],
                                          max_tokens=12, temperature=0).model_dump()
    reasoning = chat["choices"][0]["message"]["reasoning_content"]
    assert reasoning, chat
    resp = r1.oai.responses.create(model="tiny-r1", input=ask, max_output_tokens=12, temperature=0, store=False)
    assert resp.output[0].type == "reasoning" and resp.output[0].summary[0].text == reasoning
    assert resp.output_text == (chat["choices"][0]["message"]["content"] or "")
    assert resp.usage.output_tokens_details.reasoning_tokens == \
        chat["usage"]["completion_tokens_details"]["reasoning_tokens"]
    items = _check_order(_events(r1, {"model": "tiny-r1", "input": ask, "max_output_tokens": 12, "temperature": 0,
                                      "store": False}))
    assert items[0]["type"] == "reasoning" and items[0]["summary"][0]["text"] == reasoning
    assert [i["type"] for i in items] == [o.type for o in resp.output]


def test_responses_store_path_key(tmp_path):
    """ServerConfig.responsesStorePath: "" (the default) is <runDir>/responses, the one the front end
    opens (the shared server's above); a relative path is taken from the config file's directory,
    as every path key is, so that every front end process agrees on it."""
    from mindie.config import load_config

    assert load_config(None, env={}).config.server.responses_store_path == ""
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"ServerConfig": {"responsesStorePath": "shared/responses"}}))
    assert load_config(str(f), env={}).config.server.responses_store_path == str(tmp_path / "shared" / "responses")


def test_a_stored_response_survives_a_restart(smol, tmp_path):
    """ServerConfig.responsesStorePath names the store: a response stored by one server is read,
    continued and deleted, after that server stopped, by another server on that directory. The
    other server is the shared one (its store is <runDir>/responses, the default): the first one
    is told that directory, so one start of the default model does what two did; what a restart
    needs of the store (nothing in memory: every read is of the directory) is what the other
    server relies on here."""
    config = json.loads((smol.log_path.parent / "config.json").read_text())
    store = Path(config["ServerConfig"]["runDir"]) / "responses"
    (tmp_path / "a").mkdir()
    with demo_server(tmp_path / "a", "", model=DEFAULT_MODEL, server={"responsesStorePath": str(store)}) as a:
        first = _with_client(a).oai.responses.create(model=MODEL, input="What is the capital of France?",
                                                     max_output_tokens=12, temperature=0)
    assert (store / f"{first.id}.json").is_file(), "not stored where responsesStorePath says"
    assert a.proc.returncode == 0, a.tail()
    oai = smol.oai
    assert oai.responses.retrieve(first.id).output_text == first.output_text
    nxt = oai.responses.create(model=MODEL, input="And of Italy?", previous_response_id=first.id,
                               max_output_tokens=12, temperature=0, store=False)
    chat = oai.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And of Italy?"}])
    assert nxt.output_text == chat.choices[0].message.content
    oai.responses.delete(first.id)
    assert not (store / f"{first.id}.json").exists()
