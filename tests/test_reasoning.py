"""Reasoning (issue 29, point 4): the thinking of ``<think>`` models in ``reasoning_content``, the
answer in ``content``, streamed as separate deltas (mindie/text/reasoning.py).

- The splitter on scripted text: every way of cutting a text into stream pieces gives the same
  fields as the whole text, tags split across pieces included; the same through the real
  streaming detokeniser, token by token, where ``<think>`` is one token and where it is several.
- Which parser: detected from the chat template (Qwen3's: qwen3; a template whose generation
  prompt opens the block: deepseek_r1; others: none), ``ModelConfig.reasoningParser`` and MindIE's
  ``ModelConfig.models.<type>.enable_reasoning``.
- On the real launch script with tiny random checkpoints (tests/tiny_hf.py ``save_chat_model``):
  a Qwen3 model with Qwen3's real template (``chat_template_kwargs.enable_thinking: false`` reaches
  the template), and a DeepSeek-R1-style model (its answer starts inside the thinking) configured
  with MindIE's ``enable_reasoning``. The chat answer is compared with the raw text the completions
  route gives for the same prompt and seed.
- Enforced shapes (the worker masks the constrained rows): the output constrained by a regex
  (``<think>[a-z ]{0,20}</think>[a-z ]{0,20}``) or a Lark grammar naming the tags, so even noise
  thinks first and then answers; a special token's text in a regex is refused up front.
"""
from __future__ import annotations

import json
import re

import httpx
import pytest

from mindie.text.chat_template import load_chat_template
from mindie.config import ConfigError, load_config
from mindie.text.detokenizer import IncrementalDetokenizer, load_tokenizer
from mindie.text.reasoning import PARSERS, choose, detect, split
from tests.harness import demo_server
from tests.tiny_hf import QWEN3_CHAT_TEMPLATE, R1_CHAT_TEMPLATE, save_chat_model

pytestmark = pytest.mark.timeout(600)

QWEN3, R1 = PARSERS["qwen3"], PARSERS["deepseek_r1"]
Q_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
R1_PROMPT = "<s><|User|>hi<|Assistant|><think>\n"

# (parser, prompt, generated text, reasoning_content, content)
CASES = [
    (QWEN3, Q_PROMPT, "<think>\nI think\n\nit is hard\n</think>\n\nThe answer.", "I think\n\nit is hard", "The answer."),
    (QWEN3, Q_PROMPT, "  <think>abc</think>def", "abc", "def"),
    (QWEN3, Q_PROMPT, "no thinking </think> here", None, "no thinking </think> here"),
    (QWEN3, Q_PROMPT, "<thin", None, "<thin"),
    (QWEN3, Q_PROMPT, "<think>\ncut by max_tokens </thi", "cut by max_tokens </thi", ""),
    (QWEN3, Q_PROMPT, "<think></think>", "", ""),
    (QWEN3, Q_PROMPT + "<think>\n\n</think>\n\n", "answer <think>", None, "answer <think>"),  # thinking off
    (QWEN3, Q_PROMPT + "<think>\n\n</think>\n\n", "<think>x</think>y", "x", "y"),  # ... yet the model thinks
    (R1, R1_PROMPT, "thinking\n</think>\n\nanswer", "thinking", "answer"),
    (R1, R1_PROMPT, "<think>\nagain\n</think>answer\n", "again", "answer\n"),
    (R1, R1_PROMPT, "no end at all\n\n", "no end at all", ""),
    (R1, "<s><|User|>hi<|Assistant|><think>\n\n</think>\n\n", "plain </think> answer", None, "plain </think> answer"),
]


@pytest.mark.parametrize("parser,prompt,text,reasoning,content", CASES)
def test_split_and_every_stream_of_it(parser, prompt, text, reasoning, content):
    assert split(parser, prompt, text) == (reasoning, content)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            sp = parser.splitter(prompt)
            r = c = ""
            for part in (text[:i], text[i:j], text[j:]):
                dr, dc = sp.push(part)
                r, c = r + dr, c + dc
            dr, dc = sp.flush()
            assert ((r + dr) if sp.saw_reasoning else None, c + dc) == (reasoning, content), (i, j)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3", QWEN3_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def r1_dir(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("r1") / "tiny-r1", R1_CHAT_TEMPLATE, cls_name="LlamaConfig")


@pytest.mark.parametrize("tokenizer", ["one token", "several tokens"])
def test_token_by_token_through_the_detokeniser(qwen3_dir, demo_model, tokenizer):
    """``<think>`` as one added token (the Qwen3-style tokenizer) or as several byte-level pieces
    (the demo tokenizer): fed one token at a time through the streaming detokeniser, the deltas
    add up to the whole answer's fields."""
    tok = load_tokenizer(qwen3_dir if tokenizer == "one token" else demo_model)
    text = "<think>\nfirst idea, second idea\n</think>\n\nfinal answer: 42"
    ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
    think = tok.tokenizer.token_to_id("<think>")
    assert (think in ids) == (tokenizer == "one token")
    detok = IncrementalDetokenizer(tok)
    sp = QWEN3.splitter(Q_PROMPT)
    deltas = []
    for t in ids:
        deltas.append(sp.push(detok.push([t])))
    deltas.append(sp.push(detok.flush()))
    deltas.append(sp.flush())
    assert "".join(r for r, _ in deltas) == "first idea, second idea"
    assert "".join(c for _, c in deltas) == "final answer: 42"
    first_content = next(i for i, (_, c) in enumerate(deltas) if c)
    assert not any(r for r, _ in deltas[first_content:])  # the thinking all comes first
    assert not any("<" in r or ">" in r for r, _ in deltas)  # no piece of a tag leaks


def test_detected_from_the_chat_template(qwen3_dir, r1_dir, demo_model):
    assert detect(load_chat_template(qwen3_dir)) is QWEN3
    assert detect(load_chat_template(r1_dir)) is R1
    assert detect(load_chat_template(demo_model)) is None  # no template: plain ChatML


def test_chosen_by_config(qwen3_dir, demo_model):
    q3, plain = load_chat_template(qwen3_dir), load_chat_template(demo_model)
    assert choose("auto", {}, q3) is QWEN3 and choose("auto", {}, plain) is None
    assert choose("none", {"qwen3": True}, q3) is None  # the project key wins
    assert choose("deepseek_r1", {}, plain) is R1
    # MindIE's models.<type>.enable_reasoning decides under "auto"
    assert choose("auto", {"qwen3": False}, q3) is None
    assert choose("auto", {"deepseekv2": True}, q3) is R1
    assert choose("auto", {"qwen3_moe": True}, plain) is QWEN3
    assert choose("auto", {"some_type": True}, plain) is QWEN3  # a type MindIE does not list: Qwen3's rules


def test_config_keys(tmp_path):
    def load(model: dict):
        p = tmp_path / "c.json"
        p.write_text(json.dumps({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [model]}}}))
        return load_config(str(p), env={})

    m = load({"reasoningParser": "deepseek_r1", "models": {"deepseekv2": {
        "enable_reasoning": True, "tool_call_options": {"tool_call_parser": "deepseek_v3"}}}})
    model = m.config.backend.model_deploy.models[0]
    assert model.reasoning_parser == "deepseek_r1" and model.models["deepseekv2"].enable_reasoning is True
    assert not [k for k in m.ignored if "models" in k or "reasoningParser" in k]
    assert load({}).config.backend.model_deploy.models[0].reasoning_parser == "auto"
    with pytest.raises(ConfigError, match=r"ModelConfig\[0\]\.reasoningParser: must be one of"):
        load({"reasoningParser": "qwen"})
    with pytest.raises(ConfigError, match=r"enable_reasoning"):
        load({"models": {"qwen3": {"enable_reasoning": "yes"}}})


# -- on the real server -----------------------------------------------------------------------------

MSGS = [{"role": "user", "content": "What is 2+2?"}]
EARLY = "\nTime is up.\n</think>\n\n"


@pytest.fixture(scope="module")
def qwen3_srv(tmp_path_factory, qwen3_dir):
    with demo_server(tmp_path_factory.mktemp("qwen3-srv"), str(qwen3_dir), model={"modelName": "tiny-qwen3"}) as s:
        s.tok = load_tokenizer(qwen3_dir)
        s.template = load_chat_template(qwen3_dir)
        yield s


@pytest.fixture(scope="module")
def r1_srv(tmp_path_factory, r1_dir):
    # MindIE's keys for DeepSeek-R1 (ModelConfig.models.deepseekv2): enable_reasoning picks the
    # parser, early_stopping_text is what the thinking budget writes.
    with demo_server(tmp_path_factory.mktemp("r1-srv"), str(r1_dir), model={
            "modelName": "tiny-r1", "models": {"deepseekv2": {"enable_reasoning": True,
                                                              "early_stopping_text": EARLY}}}) as s:
        s.tok = load_tokenizer(r1_dir)
        s.template = load_chat_template(r1_dir)
        yield s


def _chat(srv, **body) -> dict:
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": MSGS, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _chat_stream(srv, **body) -> tuple[list[dict], dict | None]:
    """The deltas of a streamed chat answer and its usage chunk."""
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": MSGS, "stream": True,
                                                           "stream_options": {"include_usage": True}, **body},
                   timeout=120)
    assert r.status_code == 200, r.text
    deltas, usage = [], None
    for frame in r.text.split("\n\n"):
        if frame.startswith("data: {"):
            ev = json.loads(frame[6:])
            if ev["choices"]:
                deltas.append(ev["choices"][0]["delta"])
            else:
                usage = ev["usage"]
    return deltas, usage


def _raw(srv, prompt: str, **body) -> dict:
    """The completions route on the chat's prompt text: the raw generated text (no parser there)."""
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": srv.tok.tokenizer.encode(
        prompt, add_special_tokens=False).ids, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_qwen3_enable_thinking_false_reaches_the_template(qwen3_srv):
    """``chat_template_kwargs`` go to Qwen3's template: the prompt gets the closed think block, and
    the answer is all content (the raw text, as the completions route gives it)."""
    off = qwen3_srv.template.render(MSGS, enable_thinking=False)
    on = qwen3_srv.template.render(MSGS)
    assert off == on + "<think>\n\n</think>\n\n"
    params = {"max_tokens": 12, "seed": 4, "temperature": 0.9}
    a = _chat(qwen3_srv, chat_template_kwargs={"enable_thinking": False}, **params)
    assert a["usage"]["prompt_tokens"] == len(qwen3_srv.tok.tokenizer.encode(off, add_special_tokens=False).ids)
    raw = _raw(qwen3_srv, off, **params)
    msg = a["choices"][0]["message"]
    assert msg["reasoning_content"] is None and msg["content"] == raw["text"]
    assert a["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_qwen3_answer_is_split_as_the_parser_says(qwen3_srv):
    """Thinking on (the default): whatever the random model writes, the chat answer is the parser's
    split of the raw text, streamed or not."""
    prompt = qwen3_srv.template.render(MSGS)
    for seed in (1, 2):
        params = {"max_tokens": 16, "seed": seed, "temperature": 1.0}
        raw = _raw(qwen3_srv, prompt, **params)["text"]
        reasoning, content = split(QWEN3, prompt, raw)
        msg = _chat(qwen3_srv, **params)["choices"][0]["message"]
        assert (msg["reasoning_content"], msg["content"]) == (reasoning, content)
        deltas, _ = _chat_stream(qwen3_srv, **params)
        assert "".join(d.get("content", "") for d in deltas) == content
        assert "".join(d.get("reasoning_content", "") for d in deltas) == (reasoning or "")


def test_r1_answer_starts_inside_the_thinking(r1_srv):
    """DeepSeek-R1's kind (picked by MindIE's enable_reasoning under ModelConfig.models.deepseekv2):
    the prompt opens the block, so the random model's text, which never closes it, is all thinking:
    ``reasoning_content`` streamed as its own deltas, ``content`` empty, every token a reasoning
    token."""
    prompt = r1_srv.template.render(MSGS)
    assert prompt.endswith("<think>\n")
    params = {"max_tokens": 12, "seed": 9, "temperature": 1.0, "ignore_eos": True}
    raw = _raw(r1_srv, prompt, **params)["text"]
    assert "</think>" not in raw
    body = _chat(r1_srv, **params)
    msg = body["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "", "reasoning_content": raw.strip("\n")}
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 12}
    deltas, usage = _chat_stream(r1_srv, **params)
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all(set(d) <= {"reasoning_content"} for d in deltas[1:]), deltas
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    assert len([d for d in deltas if d]) > 2  # streamed piece by piece, not at the end
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 12}


def test_json_constrained_answer_is_content(r1_srv):
    """A JSON schema, JSON object or choice constraint leaves no room for a think block: the answer
    is content even where the prompt opens one."""
    body = _chat(r1_srv, max_tokens=8, seed=1, structured_outputs={"choice": ["yes", "no"]})
    msg = body["choices"][0]["message"]
    assert msg["reasoning_content"] is None and body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def _native(srv, ids: list[int], n: int, seed: int) -> list[int]:
    r = httpx.post(srv.url + "/infer_token", json={"input_id": ids, "parameters": {
        "details": True, "do_sample": True, "temperature": 1.0, "seed": seed, "max_new_tokens": n,
        "ignore_eos": True}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["details"]["generated_token_ids"]


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_budget_cuts_the_thinking(r1_srv, stream):
    """MindIE's thinking budget: after ``chat_template_kwargs.thinking_budget`` thinking tokens the
    configured early_stopping_text is written into the answer and the model answers from there: the
    tokens are those of the budget's first part, the text, then the model's continuation of prompt +
    thinking + text (the native route, same seed)."""
    budget, n, seed = 6, 30, 5
    params = {"max_tokens": n, "seed": seed, "temperature": 1.0, "ignore_eos": True,
              "chat_template_kwargs": {"thinking_budget": budget}}
    prompt = r1_srv.template.render(MSGS)
    prompt_ids = r1_srv.tok.tokenizer.encode(prompt, add_special_tokens=False).ids
    early = r1_srv.tok.tokenizer.encode(EARLY, add_special_tokens=False).ids
    first = _native(r1_srv, prompt_ids, budget, seed)
    rest = _native(r1_srv, prompt_ids + first + early, n - budget - len(early), seed)
    want = split(R1, prompt, r1_srv.tok.decode(first + early + rest))
    assert want[0].endswith("Time is up.") and want[1]
    if stream:
        deltas, usage = _chat_stream(r1_srv, **params)
        got = ("".join(d.get("reasoning_content", "") for d in deltas), "".join(d.get("content", "") for d in deltas))
    else:
        body = _chat(r1_srv, **params)
        usage, msg = body["usage"], body["choices"][0]["message"]
        got = (msg["reasoning_content"], msg["content"])
        assert body["choices"][0]["finish_reason"] == "length"
    assert got == want
    assert usage["completion_tokens"] == n
    assert usage["completion_tokens_details"]["reasoning_tokens"] == budget + early.index(
        r1_srv.tok.tokenizer.token_to_id("</think>")) + 1


def test_thinking_budget_not_reached_changes_nothing(r1_srv):
    params = {"max_tokens": 10, "seed": 6, "temperature": 1.0, "ignore_eos": True}
    plain = _chat(r1_srv, **params)["choices"][0]["message"]
    assert _chat(r1_srv, chat_template_kwargs={"thinking_budget": 50}, **params)["choices"][0]["message"] == plain
    assert _chat(r1_srv, thinking_token_budget=-1, **params)["choices"][0]["message"] == plain  # vLLM: none
    for bad in (0, -3, "5", 2**32, True):
        r = httpx.post(r1_srv.url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2,
                                                                  "chat_template_kwargs": {"thinking_budget": bad}},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


# -- enforced (the worker masks the constrained rows) ------------------------------------------------

THINK_THEN_ANSWER = "<think>[a-z ]{0,20}</think>[a-z ]{0,20}"
# The same shape with the tags as the model's own tokens: Qwen3's <think> and </think> are added
# (not special) tokens, which a Lark grammar names; a regex writes their text in byte-level pieces
# (the worker never tokenizes text into an added token).
THINK_THEN_ANSWER_LARK = "start: <think> /[a-z ]{0,20}/ </think> /[a-z ]{0,20}/"


def test_special_tokens_written_as_text_are_refused(qwen3_srv, r1_srv):
    """A regex (a grammar's string, a choice) that writes the text of one of the model's special
    tokens cannot be followed: llguidance matches the token only as itself, yet admits it where the
    text is forced, then refuses it midway (outlines#1771). Refused up front naming the field: 400 on
    OpenAI's routes, 422 on vLLM's /generate; the token named in a Lark grammar is accepted. (Added
    tokens that are not special, Qwen3's <think>, are written as text: the worker's tokenizer.)"""
    for srv, field, spec in [(qwen3_srv, "structured_outputs", {"regex": r"[a-z]{1,3}<\|im_end\|>"}),
                             (r1_srv, "guided_grammar", 'start: /[a-z]{1,3}/ "<|im_end|>"'),
                             (qwen3_srv, "guided_choice", ["a<|im_end|>", "c"])]:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, field: spec},
                       timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and "'<|im_end|>' is one token of the model" in err["message"], err
        r = httpx.post(srv.url + "/generate", json={"prompt": "x", "max_tokens": 4, field: spec}, timeout=60)
        assert r.status_code == 422 and "is one token of the model" in r.json()["error"], r.text
    r = httpx.post(qwen3_srv.url + "/v1/chat/completions", json={
        "messages": MSGS, "max_tokens": 2, "structured_outputs": {"grammar": 'start: /[a-z]{1,3}/ <|im_end|>'}},
        timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("kind,spec", [("regex", THINK_THEN_ANSWER), ("grammar", THINK_THEN_ANSWER_LARK)])
def test_qwen3_constraint_makes_noise_think_then_answer(qwen3_srv, kind, spec):
    params = {"max_tokens": 60, "seed": 3, "temperature": 1.0, "structured_outputs": {kind: spec}}
    body = _chat(qwen3_srv, **params)
    msg, choice = body["choices"][0]["message"], body["choices"][0]
    prompt = qwen3_srv.template.render(MSGS)
    raw = _raw(qwen3_srv, prompt, logprobs=0, **params)
    text = raw["text"]
    assert re.fullmatch(THINK_THEN_ANSWER, text), text
    assert choice["finish_reason"] == "stop"
    assert re.fullmatch("[a-z ]{0,20}", msg["reasoning_content"]) and re.fullmatch("[a-z ]{0,20}", msg["content"])
    assert (msg["reasoning_content"], msg["content"]) == split(QWEN3, prompt, text)
    # reasoning tokens: the generated tokens up to the one completing </think> (the added token for
    # the grammar, byte-level pieces for the regex)
    pieces = raw["logprobs"]["tokens"]
    closing = next(i for i in range(len(pieces)) if "</think>" in "".join(pieces[:i + 1]))
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == closing + 1
    assert (pieces[closing] == "</think>") == (kind == "grammar")
    deltas, usage = _chat_stream(qwen3_srv, **params)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == msg["content"]
    kinds = [k for d in deltas[1:] for k in d if k in ("reasoning_content", "content")]
    assert kinds == sorted(kinds, key=lambda k: k == "content")  # all thinking before any answer
    assert usage["completion_tokens_details"] == body["usage"]["completion_tokens_details"]


@pytest.mark.parametrize("kind", ["regex", "grammar"])
def test_r1_constraint_closes_the_thinking(r1_srv, kind):
    """R1's answer starts inside the thinking: text, </think> (as text pieces for the regex, the
    token for the grammar), text, split there, streamed or not."""
    pattern = "[a-z ]{1,20}</think>[a-z ]{1,20}"
    spec = pattern if kind == "regex" else "start: /[a-z ]{1,20}/ </think> /[a-z ]{1,20}/"
    params = {"max_tokens": 60, "seed": 2, "temperature": 1.0, "structured_outputs": {kind: spec}}
    raw = _raw(r1_srv, r1_srv.template.render(MSGS), **params)["text"]
    assert re.fullmatch(pattern, raw), raw
    msg = _chat(r1_srv, **params)["choices"][0]["message"]
    want = raw.split("</think>")
    assert (msg["reasoning_content"], msg["content"]) == (want[0], want[1])
    deltas, _ = _chat_stream(r1_srv, **params)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == want[0]
    assert "".join(d.get("content", "") for d in deltas) == want[1]


def test_qwen3_forced_call_writes_the_added_tool_call_token(qwen3_srv):
    """Qwen's ``<tool_call>`` is an added token its tokenizer does not mark special: a forced call's
    grammar names that token, so the model writes the id it was trained on (one token), not the
    delimiter's text in pieces; the call is parsed from it."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"], "additionalProperties": False}}}]
    body = _chat(qwen3_srv, tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=200,
                 seed=5, temperature=1.0, logprobs=True)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", "|".join(t["token"] for t in choice["logprobs"]["content"])
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert isinstance(json.loads(call["function"]["arguments"])["city"], str)
    pieces = [t["token"] for t in choice["logprobs"]["content"]]
    assert "<tool_call>" in pieces, pieces
