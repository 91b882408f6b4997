"""Mistral format (``mistral``, vLLM's name; MindIE has none): ``[TOOL_CALLS]`` (a special
token of Mistral's v3+ tokenizers) then a JSON list of calls, each ``{"name", "arguments"}``:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

The newer form of Mistral Small 3.2 / Magistral (``[TOOL_CALLS]get_weather[ARGS]{"city":
"Paris"}``, one ``[TOOL_CALLS]`` per call) is read too; a grammar writes the list form.
Text before ``[TOOL_CALLS]`` is content.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from mindie.text.tool_parsers.base import (CallView, Function, ToolParser, _arguments, dumps, embed_parameters,
                                      hold_partial, partial_json)

MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"
_decoder = json.JSONDecoder()


def _item(raw: str, obj: Any, complete: bool, no_str: Any = None) -> CallView:
    view = CallView(raw, complete=complete)
    if not isinstance(obj, dict):
        return view
    if complete:
        if isinstance(obj.get("name"), str):
            view.name = obj["name"]
            view.arguments = _arguments(obj.get("arguments", {}))
        return view
    if isinstance(no_str, dict) and isinstance(no_str.get("name"), str):
        view.name = no_str["name"]
    if "arguments" in obj:
        view.args = obj["arguments"]
        view.args_no_str = no_str.get("arguments") if isinstance(no_str, dict) else None
    return view


class MistralParser(ToolParser):
    name = "mistral"
    markers = (MARK, ARGS)

    def extract(self, text: str, final: bool) -> list[str | CallView]:
        i = text.find(MARK)
        if i < 0:
            return [text if final else hold_partial(text, MARK)]
        items: list[str | CallView] = [text[:i]]
        rest = text[i + len(MARK):]
        body = rest.lstrip()
        if not body:
            if final:
                items.append(CallView(text[i:], complete=True))
            return items
        if body.startswith("["):
            return items + self._list(text[i:], body, final)
        return items + self._segments(text[i:], rest, final)

    def _list(self, raw: str, body: str, final: bool) -> list[str | CallView]:
        try:
            calls, end = _decoder.raw_decode(body)
        except ValueError:  # still being written; at the end, a list that never closed is malformed
            parsed = None if final else partial_json(body)
            if parsed is None or not isinstance(parsed[0], list):
                return [CallView(raw, complete=True)] if final else []
            full, no_str = parsed
            views: list[str | CallView] = [_item(dumps(o), o, True) for o in full[:-1]]
            if full:
                last_no_str = no_str[len(full) - 1] if len(no_str) == len(full) else None
                views.append(_item("", full[-1], False, last_no_str))
            return views
        if not isinstance(calls, list):
            return [CallView(raw, complete=True)]
        views = [_item(dumps(o), o, True) for o in calls]
        if body[end:].strip():
            views.append(body[end:])
        return views

    def _segments(self, raw: str, rest: str, final: bool) -> list[str | CallView]:
        parts = rest.split(MARK)
        views: list[str | CallView] = []
        for n, part in enumerate(parts):
            last = n == len(parts) - 1
            seg = part if (final or not last) else hold_partial(part, MARK)
            k = seg.find(ARGS)
            if k < 0:
                if final or not last:
                    views.append(CallView(MARK + part, complete=True))
                elif seg.strip():
                    views.append(CallView(MARK + part))  # the name is still being written
                continue
            args_text = seg[k + len(ARGS):]
            complete = final or not last
            if not complete:
                try:
                    _, end = _decoder.raw_decode(args_text.lstrip())
                    complete = not args_text.lstrip()[end:].strip()
                except ValueError:
                    pass
            views.append(CallView.from_parts(MARK + part, seg[:k].strip(), args_text, complete))
        return views

    def render_call(self, name: str, arguments: Any) -> str:
        return f"{MARK} {dumps([{'name': name, 'arguments': arguments}])}"

    def grammar(self, functions: Sequence[Function], parallel: bool, token: Callable[[str], str]) -> str:
        call = embed_parameters(functions)
        defs, style = call.pop("$defs"), call.pop("x-guidance")
        schema = {"type": "array", "items": call, "minItems": 1, **({} if parallel else {"maxItems": 1}),
                  "$defs": defs, "x-guidance": style}
        return f'start: {token(MARK)} " " calls\ncalls: %json {dumps(schema)}'
