"""mindie/chat_template.py renders exactly as transformers' apply_chat_template(tokenize=False):
the same checkpoint files (a Qwen2.5-style tokenizer_config.json written here with Qwen2.5's
template, on the demo model's tokenizer.json), the same messages, byte-identical text."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mindie.chat_template import CHATML_FALLBACK, ChatTemplateError, load_chat_template

transformers = pytest.importorskip("transformers")

# Qwen2.5-Instruct's chat_template (tokenizer_config.json), with tools.
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Uses bos_token, strftime_now, namespace, raise_exception, a tojson option and a kwarg
# (enable_thinking, as Qwen3's template reads it).
OTHER_TEMPLATE = """{{ bos_token }}{% set ns = namespace(n=0) %}
{%- for m in messages %}
{%- if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}
{%- set ns.n = ns.n + 1 %}[{{ ns.n }}:{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}
{% endfor %}
{%- if add_generation_prompt %}[date {{ strftime_now('%Y') }}] {{ {'k': 'ü', 'a': [1, 2]} | tojson(indent=2, sort_keys=True) }}
{%- if enable_thinking is defined and enable_thinking is false %}<think>

</think>
{% endif %}[assistant]{% endif %}"""

MESSAGES = [
    [{"role": "user", "content": "Hello! Ünïcödé and \"quotes\" <b>html</b>"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "sunny", "tool_call_id": "c1"}, {"role": "tool", "content": "22C"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city — ünï",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def _checkpoint(tmp: Path, demo_model: str, template, **extra) -> Path:
    d = tmp / "ckpt"
    d.mkdir()
    shutil.copy(Path(demo_model) / "tokenizer.json", d / "tokenizer.json")
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
           "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": 32768, "chat_template": template,
           **extra}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def _hf(d: Path):
    return transformers.AutoTokenizer.from_pretrained(str(d))


@pytest.mark.parametrize("i", range(len(MESSAGES)))
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_qwen25_template_matches_transformers(tmp_path, demo_model, i, tools):
    d = _checkpoint(tmp_path, demo_model, QWEN25_TEMPLATE)
    ours = load_chat_template(d)
    assert not ours.fallback
    want = _hf(d).apply_chat_template(MESSAGES[i], tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours.render(MESSAGES[i], tools=tools) == want


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_special_tokens_kwargs_and_filters_match(tmp_path, demo_model, kwargs):
    d = _checkpoint(tmp_path, demo_model, OTHER_TEMPLATE, bos_token={"content": "<s>", "special": True,
                                                                     "__type": "AddedToken"}, eos_token="</s>")
    ours = load_chat_template(d)
    for msgs in MESSAGES[:2]:
        want = _hf(d).apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
        assert ours.render(msgs, **kwargs) == want
        assert want.startswith("<s>") and "\"k\": \"ü\"" in want


def test_raise_exception_and_named_templates(tmp_path, demo_model):
    d = _checkpoint(tmp_path, demo_model, [{"name": "default", "template": OTHER_TEMPLATE},
                                           {"name": "tool_use", "template": QWEN25_TEMPLATE}], eos_token="</s>")
    ours = load_chat_template(d)
    hf = _hf(d)
    bad = [{"role": "wizard", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="Unknown role: wizard"):
        ours.render(bad)
    with pytest.raises(Exception, match="Unknown role: wizard"):
        hf.apply_chat_template(bad, tokenize=False, add_generation_prompt=True)
    for tools in (None, TOOLS):
        want = hf.apply_chat_template(MESSAGES[0], tools=tools, tokenize=False, add_generation_prompt=True)
        assert ours.render(MESSAGES[0], tools=tools) == want


def test_sandbox_refuses_escapes(tmp_path, demo_model):
    d = _checkpoint(tmp_path, demo_model, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        load_chat_template(d).render(MESSAGES[0])


def test_fallback_chatml_without_template(tmp_path, demo_model):
    d = _checkpoint(tmp_path, demo_model, None)  # no chat template in the checkpoint
    ours = load_chat_template(d)
    assert ours.fallback and ours.source() == CHATML_FALLBACK
    assert ours.render(MESSAGES[1][1:]) == ("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
                                            "<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n")


def test_demo_model_template_matches_transformers(demo_model):
    ours = load_chat_template(demo_model)
    hf = transformers.AutoTokenizer.from_pretrained(demo_model)
    for msgs in MESSAGES[:2]:
        assert ours.render(msgs) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
