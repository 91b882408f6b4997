"""Tiny random transformers checkpoints for the tests (no weights can be downloaded here)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def random_model(cls_name: str, config: dict[str, Any], seed: int = 0) -> Any:
    """A ``transformers.<cls_name>(**config)`` causal LM with seeded random weights (eager
    attention: the textbook math as reference; ``seed``: another seed, other weights)."""
    import transformers

    cfg = getattr(transformers, cls_name)(**config)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        # Default init leaves norms at 1 and biases at 0, which would hide mapping mistakes.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias: zero would hide it
                b.normal_(0.0, 0.5)
    return model


def save_random_model(cls_name: str, config: dict[str, Any], path: Path, seed: int = 0) -> Any:
    """``random_model``, saved as safetensors in ``path``; returns the model."""
    model = random_model(cls_name, config, seed)
    model.save_pretrained(path, safe_serialization=True)
    return model


def save_random_models(root: Path, cases: dict[str, tuple[str, dict[str, Any]]],
                       base: dict[str, Any]) -> dict[str, Path]:
    """Each case ``name: (config class, extra keys)`` saved by ``save_random_model`` with the
    config ``{**base, **extra}`` in ``root / name``; returns name -> its folder (a test module's
    family fixture)."""
    for case, (cls, extra) in cases.items():
        save_random_model(cls, {**base, **extra}, root / case)
    return {case: root / case for case in cases}


# Qwen3's chat template (tokenizer_config.json of the Qwen3 checkpoints): the model thinks in
# <think>...</think> at the start of its answer; `enable_thinking: false` writes an empty, closed
# think block into the prompt; past assistant turns are rendered without their thinking.
QWEN3_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# A DeepSeek-R1-style template: the generation prompt opens the think block, so the answer starts
# inside the thinking and everything before </think> is reasoning (the reasoning parser
# deepseek_r1); past answers are rendered without their thinking.
R1_CHAT_TEMPLATE = """{{- bos_token }}{%- for message in messages %}
    {%- if message.role == 'user' %}{{- '<|User|>' + message.content }}
    {%- elif message.role == 'assistant' %}{{- '<|Assistant|>' + message.content.split('</think>')[-1] + eos_token }}
    {%- else %}{{- message.content }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|Assistant|><think>\\n' }}{%- endif %}"""

CHAT_TOKENS = ("<|im_start|>", "<|im_end|>", "<|User|>", "<|Assistant|>")  # special
TEXT_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")  # added, not special (as Qwen3's)


def save_chat_model(path: Path, template: str, *, cls_name: str = "Qwen3Config",
                    config: dict[str, Any] | None = None, seed: int = 0) -> Path:
    """A tiny random chat model in ``path``: the demo model's byte-level BPE tokenizer with Qwen3's
    chat tokens added (``<|im_start|>``/``<|im_end|>`` special, ``<think>``, ``</think>``,
    ``<tool_call>``, ``</tool_call>`` added as text tokens, as in Qwen3's tokenizer), ``template``
    as its chat template, ``<|im_end|>`` its EOS, and random weights (``cls_name`` transformers
    config, Qwen3 by default; ``config``: keys added to it, e.g. a mixture of experts'). Returns ``path``."""
    import json

    from tokenizers import AddedToken, Tokenizer

    from workers.models.demo import ensure_demo_model

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(ensure_demo_model() / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TOKENS])
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos = tok.token_to_id("<|im_end|>")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>", "unk_token": "<unk>", "model_max_length": 4096, "chat_template": template}))
    save_random_model(cls_name, {**dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                        max_position_embeddings=2048, bos_token_id=1, eos_token_id=eos,
                                        tie_word_embeddings=True), **(config or {})}, path, seed)
    return path
