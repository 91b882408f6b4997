"""Llama 3.x JSON format (``llama3_json``; MindIE: ``llama``, ``llama3``, ``llama3_1``): the whole
answer is the call, a JSON object with ``name`` and ``parameters``, after an optional
``<|python_tag|>`` (a special token of the Llama 3 tokenizer); several calls are separated by
``;``.

    {"name": "get_weather", "parameters": {"city": "Paris"}}

Llama 3.1/3.2/3.3's templates ask for it ("Respond in the format {"name": function name,
"parameters": dictionary of argument name and its value}"); ``arguments`` is read as well. There
is no markup, so an answer counts as a call only when it starts with ``{`` (or the tag) and
names one of the request's tools; any other answer is content. A grammar (``tool_choice``
``required`` or a function) makes one call: Llama 3.1's template refuses a history with several
calls in one turn.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from mindie.text.tool_parsers.base import CallView, Function, ToolParser, dumps, embed_parameters

TAG = "<|python_tag|>"
_KEYS = ("parameters", "arguments")
_decoder = json.JSONDecoder()


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = (TAG,)
    args_key = "parameters"

    def accepts(self, name: str) -> bool:
        return not self.tool_names or name in self.tool_names

    def extract(self, text: str, final: bool) -> list[str | CallView]:
        start = _skip_ws(text, 0)
        head = text[start:]
        if head.startswith(TAG):
            start = _skip_ws(text, start + len(TAG))
        elif not final and TAG.startswith(head):  # nothing yet, or what may be the tag
            return []
        elif not head.startswith("{"):
            return [text]
        if not final and start == len(text):
            return []
        items: list[str | CallView] = []
        pos, first = start, True
        while pos < len(text):
            raw_from = 0 if first else pos
            first = False
            try:
                _, end = _decoder.raw_decode(text, pos)
            except ValueError:  # still being written (or malformed: judged at the end)
                items.append(CallView.from_object(text[raw_from:], text[pos:], final, _KEYS))
                return items
            items.append(CallView.from_object(text[raw_from:end], text[pos:end], True, _KEYS))
            pos = _skip_ws(text, end)
            if pos < len(text) and text[pos] == ";":
                pos = _skip_ws(text, pos + 1)
            elif pos < len(text):
                items.append(text[pos:])  # text after the calls
                return items
        return items

    def render_call(self, name: str, arguments: Any) -> str:
        return dumps({"name": name, "parameters": arguments})

    def grammar(self, functions: Sequence[Function], parallel: bool, token: Callable[[str], str]) -> str:
        return f"start: %json {dumps(embed_parameters(functions, args_key='parameters'))}"
