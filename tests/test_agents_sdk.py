"""The OpenAI Agents SDK (``openai-agents``) with its default Responses model,
``OpenAIResponsesModel``, runs a tool loop end to end against ``POST /v1/responses`` (issue 54,
item 2) on the real launch script: the default model's shared server (SmolLM2-135M-Instruct),
forced by ``tool_choice="required"`` (the server's grammar) to call a function tool; the SDK runs
the tool, sends its output back as a ``function_call_output`` item (tool_choice reset, so the
next turn answers in text) and ends with a final text output. Plain and streamed runs; every
request body the SDK sent is recorded, and the final answer is the chat route's for the same
conversation (greedy)."""
from __future__ import annotations

import asyncio
import functools
import json

import httpx
import jsonschema
import pydantic
import pytest

from tests.harness import default_model_server
from tests.lazy_modules import lazy_module

openai = lazy_module("openai")  # imported where a test uses it (tests/lazy_modules.py)
agents = lazy_module("agents")  # imported where a test uses it (tests/lazy_modules.py)
responses_types = lazy_module("openai.types.responses")

pytestmark = pytest.mark.timeout(600)


@functools.cache
def _event() -> pydantic.TypeAdapter:
    """The Responses API's stream events, as the openai package types them."""
    return pydantic.TypeAdapter(responses_types.ResponseStreamEvent)


MODEL = "SmolLM2-135M-Instruct"
ASK = "What is the weather in Paris?"
INSTRUCTIONS = "You are a weather assistant. Use the get_weather tool, then answer in one sentence."


@pytest.fixture(scope="module")
def smol(demo_servers):
    agents.set_tracing_disabled(True)  # nothing is sent anywhere but the server under test
    return default_model_server(demo_servers)


class _Recorder:
    """An AsyncOpenAI client of the server whose POST /v1/responses bodies are kept."""

    def __init__(self, url: str):
        self.bodies: list[dict] = []

        async def keep(request: httpx.Request) -> None:
            if request.method == "POST" and request.url.path.endswith("/responses"):
                self.bodies.append(json.loads(request.content))

        async def answered(response: httpx.Response) -> None:
            if response.request.method == "POST":
                self.ignored.append(response.headers.get("x-ignored-fields"))
                if response.headers.get("content-type", "").startswith("application/json"):
                    await response.aread()  # the whole object, validated strictly (the SDK does not)
                    self.responses.append(responses_types.Response.model_validate_json(response.content))

        self.ignored: list[str | None] = []
        self.responses: list[responses_types.Response] = []
        http = httpx.AsyncClient(timeout=120, event_hooks={"request": [keep], "response": [answered]})
        self.client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, http_client=http)


def _agent(recorder: _Recorder, calls: list[str]):
    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        calls.append(city)
        return json.dumps({"city": city, "forecast": "sunny", "high_c": 24})

    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=recorder.client)
    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=160)
    return agents.Agent(name="weather", instructions=INSTRUCTIONS, tools=[get_weather], model=model,
                        model_settings=settings), get_weather


def _check_run(smol, result, recorder: _Recorder, calls: list[str], tool) -> None:
    """One tool call with schema-valid arguments, its output sent back to the server, a final text
    that is the chat route's answer to the same conversation."""
    kinds = [type(i).__name__ for i in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"], kinds
    call = result.new_items[0].raw_item
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    args = json.loads(call.arguments)
    jsonschema.validate(args, tool.params_json_schema)
    assert calls == [args["city"]], calls
    output = result.new_items[1].output
    assert json.loads(output)["city"] == args["city"]
    assert isinstance(result.final_output, str) and result.final_output
    # what the server was sent: the forced first turn, then the conversation with the call and its output
    first, second = recorder.bodies
    assert first["tool_choice"] == "required" and first["tools"][0]["name"] == "get_weather"
    assert first["parallel_tool_calls"] is False
    assert recorder.ignored == [None, None]  # every field the SDK sends is read
    assert second.get("tool_choice") in (None, "auto"), second  # reset after the tool ran
    sent = [i.get("type", "message") for i in second["input"]]
    assert sent[-2:] == ["function_call", "function_call_output"], second["input"]
    assert second["input"][-1]["call_id"] == call.call_id and second["input"][-1]["output"] == output
    # greedy: the chat route's answer to the same conversation
    tool_def = {"type": "function", "function": {"name": "get_weather", "description": tool.description,
                                                 "parameters": tool.params_json_schema, "strict": True}}
    chat = httpx.post(smol.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "temperature": 0, "max_tokens": 160, "tools": [tool_def],
        "parallel_tool_calls": False, "messages": [
            {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": ASK},
            {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                                                                    "function": {"name": call.name,
                                                                                 "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": output}]}).json()
    assert result.final_output == chat["choices"][0]["message"]["content"], chat


def test_runner_run_tool_loop(smol):
    recorder, calls = _Recorder(smol.url), []
    agent, tool = _agent(recorder, calls)
    result = asyncio.run(agents.Runner.run(agent, ASK, max_turns=4))
    _check_run(smol, result, recorder, calls, tool)
    assert all(not b.get("stream") for b in recorder.bodies)
    assert [r.status for r in recorder.responses] == ["completed", "completed"]
    assert [o.type for o in recorder.responses[0].output] == ["function_call"]


def test_runner_run_streamed_tool_loop(smol):
    recorder, calls = _Recorder(smol.url), []
    agent, tool = _agent(recorder, calls)

    async def run():
        result = agents.Runner.run_streamed(agent, ASK, max_turns=4)
        raw, items = [], []
        async for event in result.stream_events():
            if event.type == "raw_response_event":  # each event as the openai package types it, strictly
                raw.append(_event().validate_python(event.data.model_dump(mode="json")).type)
            elif event.type == "run_item_stream_event":
                items.append(event.name)
        return result, raw, items

    result, raw, items = asyncio.run(run())
    _check_run(smol, result, recorder, calls, tool)
    assert all(b.get("stream") for b in recorder.bodies)
    assert "response.function_call_arguments.delta" in raw and "response.output_text.delta" in raw, raw
    assert raw.count("response.completed") == 2, raw
    assert items == ["tool_called", "tool_output", "message_output_created"], items
