"""Harmony format (``harmony``; vLLM's name ``openai``: GPT-OSS): a tool call is a ``commentary``
message addressed to the function, its body the JSON arguments, ended by ``<|call|>``:

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the recipient may stand in the role part of the header instead: ``<|start|>assistant
to=functions.get_weather<|channel|>commentary json<|message|>...``). The messages are read by
mindie/text/harmony.py. After the harmony reasoning parser has taken the ``analysis`` messages
out, the content holds the answer's text and the calls in this form; read without it (the text as
the model wrote it), a message to no function is content, its body without the markers.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mindie.text import harmony
from mindie.text.tool_parsers.base import (CallView, Function, ToolParser, dumps, lark_literal,
                                           standalone_parameters)


class HarmonyParser(ToolParser):
    name = "harmony"
    markers = harmony.MARKERS

    def extract(self, text: str, final: bool) -> list[str | CallView]:
        lead, msgs = harmony.parse(text, final)
        items: list[str | CallView] = [lead]
        for m in msgs:
            if not m.header_done:
                if final:
                    items.append(CallView(m.raw, complete=True))  # a header cut off: content as written
                else:
                    items.append(CallView(m.raw))  # too little to say yet
                break
            name = m.call_name
            if name is None:
                items.append(m.body)
                continue
            items.append(CallView.from_parts(m.raw, name, m.body, m.complete or final))
        return items

    def grammar(self, functions: Sequence[Function], parallel: bool, token: Callable[[str], str]) -> str:
        # One call: <|call|> ends the model's turn (an end-of-sequence token of GPT-OSS), so a
        # parallel request still gets one call per answer, as GPT-OSS writes them.
        lines = ["start: " + " | ".join(f"call{i}" for i in range(len(functions)))]
        for i, f in enumerate(functions):
            head = lark_literal(f"commentary to=functions.{f.name} ")
            lines.append(f"call{i}: {token(harmony.CHANNEL)} {head} {token(harmony.CONSTRAIN)} \"json\" "
                         f"{token(harmony.MESSAGE)} args{i} {token(harmony.CALL)}")
            lines.append(f"args{i}: %json {dumps(standalone_parameters(f))}")
        return "\n".join(lines)

    def render_call(self, name: str, arguments: Any) -> str:
        args = arguments if isinstance(arguments, str) else dumps(arguments)
        return f"{harmony.START}assistant{harmony.call_text(name, args, True)}"
