"""mindie/text/chat_template.py renders exactly as transformers' apply_chat_template(tokenize=False):
the same checkpoint files (a Qwen2.5-style tokenizer_config.json written here with Qwen2.5's
template, on the demo model's tokenizer.json), the same messages, byte-identical text."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mindie.text.chat_template import CHATML_FALLBACK, ChatTemplateError, load_chat_template

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


# Meta-Llama-3.1-8B-Instruct's chat_template (tokenizer_config.json; JSON tool calling, tools in the
# first user message, tool results as the ipython role).
LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# A tool round trip as an OpenAI client sends it back (issue 29): arguments as a JSON string, the
# call's content null, tool results with their call id; and as transformers documents it for
# apply_chat_template (arguments as a dict), which is what the template must see.
OPENAI_HISTORY = [
    {"role": "system", "content": "You answer with tools."},
    {"role": "user", "content": "Weather in Zürich, and 2+3?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\", \"days\": [1, 2]}"}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "{\"sky\": \"sunny\", \"t\": 21}"},
    {"role": "assistant", "content": "Sunny. Now the sum.", "tool_calls": [
        {"id": "call_b", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
    {"role": "tool", "tool_call_id": "call_b", "content": "5"},
]
HF_HISTORY = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                                   for c in m["tool_calls"]]} if "tool_calls" in m else m for m in OPENAI_HISTORY]
HISTORY_TOOLS = TOOLS + [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


@pytest.mark.parametrize("i", range(len(MESSAGES)))
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_llama31_template_matches_transformers(tmp_path, demo_model, i, tools):
    d = _checkpoint(tmp_path, demo_model, LLAMA31_TEMPLATE, bos_token="<s>", eos_token="</s>")
    want = _hf(d).apply_chat_template(MESSAGES[i], tools=tools, tokenize=False, add_generation_prompt=True)
    assert load_chat_template(d).render(MESSAGES[i], tools=tools) == want


@pytest.mark.parametrize("template", ["qwen25", "llama31"])
def test_openai_tool_history_renders_as_transformers(tmp_path, demo_model, template):
    """An OpenAI client's tool history (arguments as JSON strings) through the chat route's
    preparation (mindie/text/tool_calls.py) renders byte for byte as transformers renders the same
    conversation in its documented form (arguments as dicts)."""
    from mindie.text.detokenizer import load_tokenizer
    from mindie.text.tool_calls import ToolSupport

    src = QWEN25_TEMPLATE if template == "qwen25" else LLAMA31_TEMPLATE
    d = _checkpoint(tmp_path, demo_model, src, bos_token="<s>", eos_token="</s>")
    ours = load_chat_template(d)
    support = ToolSupport(ours, load_tokenizer(d))
    assert support.renders_tools and support.renders_calls
    assert support.parser_cls.name == ("hermes" if template == "qwen25" else "llama3_json")
    history = OPENAI_HISTORY if template == "qwen25" else OPENAI_HISTORY[:4]  # Llama 3.1: no text beside a call
    want = _hf(d).apply_chat_template(HF_HISTORY[:len(history)], tools=HISTORY_TOOLS, tokenize=False,
                                      add_generation_prompt=True)
    treq = support.request(HISTORY_TOOLS, None, None)
    assert ours.render(support.messages(history, treq), tools=HISTORY_TOOLS) == want
    assert ours.render(history, tools=HISTORY_TOOLS) != want  # the wire form as is would not
    # arguments already given as a dict (what transformers takes) render the same
    assert ours.render(support.messages(HF_HISTORY[:len(history)], treq), tools=HISTORY_TOOLS) == want
