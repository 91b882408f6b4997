"""DeepSeek formats, in DeepSeek's own tokens (``<｜tool▁calls▁begin｜>`` and its siblings).

``deepseek_v3`` (MindIE: ``deepseek_v3``, ``deepseekv3``, ``deepseek_v2``, ``deepseekv2``;
DeepSeek-V3-0324, R1-0528): the name after ``function<｜tool▁sep｜>``, the arguments in a json
code fence::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

``deepseek_v31`` (MindIE: ``deepseek_v31``, ``deepseekv31``; DeepSeek-V3.1): the name, then the
arguments straight after ``<｜tool▁sep｜>``::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Several calls follow each other (a newline between them in v3). Text before
``<｜tool▁calls▁begin｜>`` is content.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mindie.text.tool_parsers.base import (CallView, Function, ToolParser, dumps, hold_partial, lark_literal,
                                      standalone_parameters)

BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "```json\n", "\n```"


class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"
    markers = (BEGIN, END, CALL_BEGIN, CALL_END, SEP)
    between = '"\\n" '  # what the grammar writes between two calls (a newline, as v3's template)

    def extract(self, text: str, final: bool) -> list[str | CallView]:
        i = text.find(BEGIN)
        if i < 0:
            return [text if final else hold_partial(text, BEGIN)]
        items: list[str | CallView] = [text[:i]]
        # The calls' raw texts cover the whole markup (delimiters and separators included), so
        # calls that all turn out malformed give back exactly the text.
        pos, raw_from = i + len(BEGIN), i
        while True:
            j = text.find(CALL_BEGIN, pos)
            e = text.find(END, pos)
            if e >= 0 and (j < 0 or e < j):  # the calls end; what follows is content
                tail = text[raw_from:e + len(END)]
                if isinstance(items[-1], CallView):
                    items[-1].raw += tail
                else:  # the markup holds no call at all: it is content
                    items.append(tail)
                items.append(text[e + len(END):])
                return items
            if j < 0:
                if final and text[pos:].strip():
                    items.append(text[raw_from:])
                return items
            k = text.find(CALL_END, j)
            complete = k >= 0 or final
            inner = text[j + len(CALL_BEGIN):k if k >= 0 else len(text)]
            if not complete:
                inner = hold_partial(inner, CALL_END)
            end = k + len(CALL_END) if k >= 0 else len(text)
            items.append(self._call(text[raw_from:end], inner, complete))
            if k < 0:
                return items
            pos = raw_from = end

    def _call(self, raw: str, inner: str, complete: bool) -> CallView:
        k = inner.find(SEP)
        if k < 0:
            return CallView(raw, complete=complete)
        after = inner[k + len(SEP):]
        nl = after.find("\n")
        if nl < 0:
            return CallView.from_parts(raw, after.strip() if complete else None, "", complete)
        name, args = after[:nl].strip(), after[nl + 1:]
        if args.startswith("```"):
            fence = args.find("\n")
            args = args[fence + 1:] if fence >= 0 else ""
        close = args.find(FENCE_CLOSE)
        if close >= 0:
            args = args[:close]
        elif complete:
            args = args.rstrip().removesuffix("```")
        else:
            args = hold_partial(args, FENCE_CLOSE)
        return CallView.from_parts(raw, name, args, complete)

    def render_call(self, name: str, arguments: Any) -> str:
        return (f"{BEGIN}{CALL_BEGIN}function{SEP}{name}\n{FENCE_OPEN}{dumps(arguments)}{FENCE_CLOSE}"
                f"{CALL_END}{END}")

    def _function(self, f: Function, sep: str) -> str:
        return f'{lark_literal("function")} {sep} {lark_literal(f.name + chr(10) + FENCE_OPEN)} ' \
               f'%json {dumps(standalone_parameters(f))} {lark_literal(FENCE_CLOSE)}'

    def grammar(self, functions: Sequence[Function], parallel: bool, token: Callable[[str], str]) -> str:
        sep = token(SEP)
        lines = ["start: " + token(BEGIN) + " calls " + token(END),
                 "calls: call" + (f" ({self.between}call)*" if parallel else ""),
                 f"call: {token(CALL_BEGIN)} fn {token(CALL_END)}",
                 "fn: " + " | ".join(f"f{i}" for i in range(len(functions)))]
        lines += [f"f{i}: {self._function(f, sep)}" for i, f in enumerate(functions)]
        return "\n".join(lines)


class DeepSeekV31Parser(DeepSeekV3Parser):
    name = "deepseek_v31"
    between = ""

    def _call(self, raw: str, inner: str, complete: bool) -> CallView:
        k = inner.find(SEP)
        if k < 0:
            return CallView(raw, complete=complete)
        return CallView.from_parts(raw, inner[:k].strip(), inner[k + len(SEP):], complete)

    def render_call(self, name: str, arguments: Any) -> str:
        return f"{BEGIN}{CALL_BEGIN}{name}{SEP}{dumps(arguments)}{CALL_END}{END}"

    def _function(self, f: Function, sep: str) -> str:
        return f"{lark_literal(f.name)} {sep} %json {dumps(standalone_parameters(f))}"

