"""Hermes / Qwen format (``hermes``; MindIE: ``hermes``, ``qwen3``, ``qwen3_moe``, ``qwen2_5``):
each call is a JSON object in ``<tool_call>`` tags, one per line, text allowed around them.

    I will look it up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Qwen2.5, Qwen3 and Hermes 2/3 write it (their tokenizers have ``<tool_call>`` and
``</tool_call>`` as added, non-special tokens); it is also the format this server presents tools
in to a model whose chat template does not render them (mindie/text/tool_calls.py).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mindie.text.tool_parsers.base import CallView, Function, ToolParser, dumps, embed_parameters, hold_partial

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    markers = (START, END)

    def extract(self, text: str, final: bool) -> list[str | CallView]:
        items: list[str | CallView] = []
        pos = 0
        while True:
            i = text.find(START, pos)
            if i < 0:
                items.append(text[pos:] if final else hold_partial(text[pos:], START))
                return items
            items.append(text[pos:i])
            body_at = i + len(START)
            j = text.find(END, body_at)
            if j < 0:
                body = text[body_at:] if final else hold_partial(text[body_at:], END)
                items.append(CallView.from_object(text[i:], body, final))
                return items
            items.append(CallView.from_object(text[i:j + len(END)], text[body_at:j], True))
            pos = j + len(END)

    def render_call(self, name: str, arguments: Any) -> str:
        return f"{START}\n{dumps({'name': name, 'arguments': arguments})}\n{END}"

    def grammar(self, functions: Sequence[Function], parallel: bool, token: Callable[[str], str]) -> str:
        call = f'{token(START)} "\\n" body "\\n" {token(END)}'
        return "\n".join([
            "start: call" + (' ("\\n" call)*' if parallel else ""),
            f"call: {call}",
            f"body: %json {dumps(embed_parameters(functions))}",
        ])
