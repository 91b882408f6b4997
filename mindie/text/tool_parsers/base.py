"""What every tool-call format shares: the view of a call in the text, the streaming engine that
turns growing text into OpenAI's deltas, and the JSON and grammar helpers.

A format (one module each: hermes.py, llama3.py, mistral.py, deepseek.py) only says where its
calls are: ``ToolParser.extract(text, final)`` splits the text generated so far into content
strings and ``CallView``s, in order. ``ToolCallStream`` does the rest, the same way for every
format and for both answer shapes:

- it re-reads the whole text each step (this is what makes a tag or a JSON string split across
  tokens at any position come out right) and sends only what is new; inside a call whose text
  has grown past 4 KB (code, a document as an argument) it re-reads each time the text has grown
  by 1/64 instead, which keeps a long call's cost linear (20 KB of arguments: 0.3 s of front-end
  time instead of 4.4 s) and is the same as those tokens arriving together;
- content is what lies outside the calls; a format holds back the end of the text that could
  still be the start of its markup, so markup never reaches the content, even split; content
  that is only whitespace is never sent (and the non-stream answer's ``content`` is then null),
  nor is whitespace between or after calls;
- a call is announced (OpenAI's first delta: ``index``, ``id``, ``type``, ``function.name``)
  once its name is complete, then its arguments follow as fragments: the canonical JSON text
  (``json.dumps``, ensure_ascii off) of the arguments parsed so far by ``partial-json-parser``,
  cut where it could still change (a number still being written is left out; the closing
  quotes and brackets the partial parse added are cut), so the fragments always add up to the
  final ``arguments`` string;
- the non-stream answer is the same engine fed the whole text at once (``parse_text``), so a
  stream and a non-stream answer of the same text say the same thing.

A call that turns out malformed (its JSON does not parse once its end is written, or it has no
name) is content, markup and all, as vLLM and MindIE return it. A call cut off before its end
(max_tokens, or the model stopped) whose name was complete stays a call with the arguments written
so far, streamed or not (a stream has announced it by then; OpenAI answers a cut call so too).
"""
from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import partial_json_parser
from partial_json_parser import Allow

__all__ = ["CallView", "Function", "ToolParser", "ToolCallStream", "parse_text", "new_call_id", "hold_partial",
           "partial_json", "final_json", "lark_literal", "embed_parameters", "NO_PARAMETERS"]

# Partial values the stream may show: containers and strings being written; never a number
# being written ("3" may become "35"). Booleans and null are unambiguous from their first letter.
_ALLOW = Allow.ALL & ~Allow.NUM & ~Allow.NAN & ~Allow.INFINITY
_ALLOW_NO_STR = _ALLOW & ~Allow.STR
_ID_CHARS = string.ascii_letters + string.digits
# A stream re-reads its whole text at each step; past LONG_TEXT characters, while a call is being
# written, only each time the text has grown by 1/LONG_TEXT_SHARE (ToolCallStream._push).
LONG_TEXT, LONG_TEXT_SHARE = 4096, 64
# A function without ``parameters`` takes none (OpenAI): its arguments are ``{}``.
NO_PARAMETERS: dict = {"type": "object", "properties": {}, "additionalProperties": False}
# The JSON a grammar makes the model write: no free whitespace (a weak model would fill
# max_tokens with it), json.dumps' separators (what the formats' own examples show).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def new_call_id() -> str:
    """An OpenAI-style tool call id: ``call_`` and 24 letters or digits."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def hold_partial(text: str, *markers: str) -> str:
    """``text`` without its longest ending that could be the start of one of ``markers``."""
    cut = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), cut, -1):
            if text.endswith(m[:k]):
                cut = k
                break
    return text[:len(text) - cut] if cut else text


def partial_json(text: str) -> tuple[Any, Any] | None:
    """(the value parsed so far, the same without a string still being written), or None when
    ``text`` is not the start of a JSON value."""
    t = text.strip()
    if not t:
        return None
    try:
        return partial_json_parser.loads(t, _ALLOW), partial_json_parser.loads(t, _ALLOW_NO_STR)
    except (partial_json_parser.MalformedJSON, ValueError, IndexError, RecursionError):
        return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_MISSING = object()


def final_json(text: str) -> Any:
    """The JSON value ``text`` holds (surrounding whitespace allowed), or ``_MISSING``."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return _MISSING


def _stable(args: Any, args_no_str: Any) -> str | None:
    """The part of the final arguments text that ``args`` (parsed so far) already fixes."""
    if not isinstance(args, dict):
        return None
    s = dumps(args).rstrip("]}")  # brackets the partial parse closed (real ones come back at the end)
    if args != args_no_str:  # the last value is a string still being written: its closing quote is not
        if not s.endswith('"'):
            return None
        s = s[:-1]
    if s and "\ud800" <= s[-1] <= "\udbff":  # half of a surrogate pair written as \\u escapes
        s = s[:-1]
    return s


@dataclass
class CallView:
    """One call as far as the text shows it."""

    raw: str  # its text, markup included (what the content gets when it is malformed)
    name: str | None = None  # once complete
    args: Any = None  # the arguments parsed so far (partial strings included)
    args_no_str: Any = None  # the same without a string still being written
    complete: bool = False  # its text is final
    arguments: str | None = None  # complete and well formed: the arguments as JSON text

    @property
    def valid(self) -> bool:
        return self.complete and self.name is not None and self.arguments is not None

    @classmethod
    def from_object(cls, raw: str, body: str, complete: bool, args_keys: Sequence[str] = ("arguments",)) -> CallView:
        """A call written as one JSON object ``{"name": ..., <args key>: {...}}`` (Hermes, Llama 3,
        Mistral's list items)."""
        view = cls(raw, complete=complete)
        if complete:
            obj = final_json(body)
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                view.name = obj["name"]
                view.arguments = _arguments(next((obj[k] for k in args_keys if k in obj), {}))
            return view
        parsed = partial_json(body)
        if parsed is None or not isinstance(parsed[0], dict):
            return view
        full, no_str = parsed
        if isinstance(no_str.get("name"), str):
            view.name = no_str["name"]
        key = next((k for k in args_keys if k in full), None)
        if key is not None:
            view.args, view.args_no_str = full[key], no_str.get(key)
        return view

    @classmethod
    def from_parts(cls, raw: str, name: str | None, args_text: str, complete: bool) -> CallView:
        """A call whose name and arguments are written apart (DeepSeek, Mistral's newer form)."""
        view = cls(raw, name=name, complete=complete)
        if complete:
            view.arguments = _arguments(final_json(args_text)) if args_text.strip() else "{}"
            return view
        parsed = partial_json(args_text)
        if parsed is not None:
            view.args, view.args_no_str = parsed
        return view


def _arguments(value: Any) -> str | None:
    """The arguments of a finished call as JSON text: an object, or an object written as a JSON
    string (some models quote it); None when malformed."""
    if isinstance(value, str):
        value = final_json(value)
    if isinstance(value, dict):
        return dumps(value)
    return None


@dataclass(frozen=True)
class Function:
    """A tool of the request (validated): what the grammar and the instructions need."""

    name: str
    parameters: dict
    description: str = ""
    raw: dict = field(default_factory=dict, compare=False)  # the request's tool object as sent


class ToolParser:
    """One model family's tool-call format (a subclass per format, registered by name)."""

    name: ClassVar[str] = ""
    # The format's delimiters. Where the model's tokenizer has one as a special token, the
    # front end keeps that token in the text (detokenisers drop special tokens), and a grammar
    # names it as a token.
    markers: ClassVar[tuple[str, ...]] = ()
    args_key: ClassVar[str] = "arguments"  # what the format calls the arguments in its JSON

    def __init__(self, tool_names: Collection[str] = ()):
        self.tool_names = frozenset(tool_names)

    def extract(self, text: str, final: bool) -> list[str | CallView]:
        """The text generated so far as content strings and calls, in order. Unless ``final``,
        an ending that could still become markup is left out (it is neither content nor call
        yet), and the last call may be incomplete."""
        raise NotImplementedError

    def grammar(self, functions: Sequence[Function], parallel: bool, token: Callable[[str], str]) -> str:
        """A Lark grammar (llguidance's dialect) of one call (``parallel``: one or more) of
        ``functions`` in this format, nothing else. ``token(marker)`` writes a delimiter: the
        special token where the tokenizer has one, else the literal text."""
        raise NotImplementedError

    def render_call(self, name: str, arguments: Any) -> str:
        """A call as the model writes it (for a history the chat template cannot render)."""
        raise NotImplementedError

    def instructions(self, functions: Sequence[Function]) -> str:
        """A system-prompt text that presents the tools and this format, for a chat template
        that does not render tools itself."""
        listing = "\n".join(dumps(f.raw or {"type": "function", "function": {"name": f.name}}) for f in functions)
        example = self.render_call("<function-name>", {"<parameter>": "<value>"})
        return ("# Tools\n\nYou may call one or more functions to answer the user. The functions you can call, "
                "one JSON object per line, within <tools></tools> XML tags:\n"
                f"<tools>\n{listing}\n</tools>\n\nTo call a function, write exactly this, with its arguments as "
                f"a JSON object matching its parameters:\n{example}")

    def render_result(self, content: str) -> str:
        """A tool's result as a user turn (for a history the chat template cannot render)."""
        return f"<tool_response>\n{content}\n</tool_response>"

    def accepts(self, name: str) -> bool:
        """Whether a complete name makes this a call (formats without markup check the tools)."""
        return True


def lark_literal(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _rewrite_refs(node: Any, base: str) -> Any:
    """``node`` with every local ``$ref`` ("#...") made relative to ``base`` (where ``node``
    moves to inside a larger schema)."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str) and v.startswith("#"):
                out[k] = base + v[1:]
            else:
                out[k] = _rewrite_refs(v, base)
        return out
    if isinstance(node, list):
        return [_rewrite_refs(v, base) for v in node]
    return node


def embed_parameters(functions: Sequence[Function], *, name_key: str = "name",
                     args_key: str = "arguments") -> dict:
    """One JSON schema for a call of any of ``functions`` written as
    ``{"name": <name>, <args_key>: <arguments>}``: each function's parameters move into
    ``$defs`` (their own ``$ref``s rewritten to follow), the name is a ``const``, and the JSON
    style is fixed (``_JSON_STYLE``)."""
    defs: dict[str, Any] = {}
    variants = []
    for i, f in enumerate(functions):
        key = f"args{i}"
        defs[key] = _rewrite_refs(f.parameters, f"#/$defs/{key}")
        variants.append({"type": "object", "properties": {name_key: {"const": f.name}, args_key: {"$ref": f"#/$defs/{key}"}},
                         "required": [name_key, args_key], "additionalProperties": False})
    schema: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return {**schema, "$defs": defs, "x-guidance": dict(_JSON_STYLE)}


def standalone_parameters(f: Function) -> dict:
    """``f``'s parameters as a schema of their own, in the grammar's JSON style."""
    return {**f.parameters, "x-guidance": dict(_JSON_STYLE)}


class ToolCallStream:
    """Turns a growing text into content and OpenAI tool-call deltas (see the module docstring)."""

    def __init__(self, parser: ToolParser, parallel: bool = True):
        self.parser = parser
        self.parallel = parallel  # False: only the first call counts (parallel_tool_calls: false)
        self.text = ""
        self.calls: list[dict] = []  # the calls announced: OpenAI's tool_call objects, arguments as sent
        self._slots: list[str | int] = []  # per call in the text: its index in calls, "content" or "dropped"
        self._content_len = 0  # of the content read so far
        self._spoke = False  # some non-whitespace content was sent
        self._held_ws = ""  # whitespace-only content not sent yet
        self._sent: list[str] = []  # arguments text sent, per announced call
        self._read_len = 0  # len(text) when it was last read
        self._in_call = False  # the last read ended inside a call

    @property
    def content_sent(self) -> bool:
        return self._spoke

    def push(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        """Add ``delta``; return (new content, new tool-call deltas). ``final``: the text is
        complete (incomplete markup becomes content, an unfinished call is judged as it is).

        The last piece is read as text first, then as the end: what it says does not depend on
        where the pieces were cut (a call whose name the last piece completes is a call, as it
        would be had that piece come one token earlier)."""
        if not final:
            return self._push(delta, False)
        content, deltas = self._push(delta, False)
        more, last = self._push("", True)
        merged = {d["index"]: d for d in deltas}
        for d in last:
            if d["index"] in merged:  # a call announced by the first pass: its new fragment
                f = merged[d["index"]]["function"]
                f["arguments"] = f.get("arguments", "") + d["function"].get("arguments", "")
            else:
                merged[d["index"]] = d
        return content + more, [merged[i] for i in sorted(merged)]

    def _push(self, delta: str, final: bool) -> tuple[str, list[dict]]:
        self.text += delta
        n = len(self.text)
        if not final and self._in_call and n > LONG_TEXT and (n - self._read_len) * LONG_TEXT_SHARE < n:
            # Inside a long call each read re-parses its JSON (O(length)): read again only once the
            # text has grown by 1/LONG_TEXT_SHARE, which keeps a whole answer's reading linear. Safe:
            # it is the same as these pieces arriving as one, and any cut is read right.
            return "", []
        self._read_len = n
        items = self.parser.extract(self.text, final)
        self._in_call = bool(items) and not isinstance(items[-1], str) and not items[-1].complete
        content: list[str] = []
        out: dict[int, dict] = {}  # index -> the delta of that call in this push
        k = 0
        for item in items:
            if isinstance(item, str):
                if k == 0 or item.strip():  # whitespace between and after calls is not content
                    content.append(item)
                continue
            if k == len(self._slots):
                self._slots.append("")
            slot = self._slots[k]
            k += 1
            if slot == "":  # not decided yet
                if item.complete and not (item.valid and self.parser.accepts(item.name)):
                    slot = self._slots[k - 1] = "content"
                elif item.name is not None and self.parser.accepts(item.name):
                    if not self.parallel and self.calls:
                        slot = self._slots[k - 1] = "dropped"
                    else:
                        slot = self._slots[k - 1] = len(self.calls)
                        call = {"id": new_call_id(), "type": "function",
                                "function": {"name": item.name, "arguments": ""}}
                        self.calls.append(call)
                        self._sent.append("")
                        out[slot] = {"index": slot, "id": call["id"], "type": "function",
                                     "function": {"name": item.name, "arguments": ""}}
                else:
                    break  # the last item, and too little of it to say: wait
            if slot == "content":
                content.append(item.raw)
            elif isinstance(slot, int):
                target = item.arguments if item.valid else (None if item.complete else _stable(item.args, item.args_no_str))
                sent = self._sent[slot]
                if target is not None and len(target) > len(sent) and target.startswith(sent):
                    frag = target[len(sent):]
                    self._sent[slot] = target
                    self.calls[slot]["function"]["arguments"] = target
                    d = out.setdefault(slot, {"index": slot, "function": {}})
                    d["function"]["arguments"] = d["function"].get("arguments", "") + frag
        return self._content(content), [out[i] for i in sorted(out)]

    def _content(self, pieces: list[str]) -> str:
        text = "".join(pieces)
        new = text[self._content_len:]
        self._content_len = len(text)
        if self._spoke:
            return new
        buf = self._held_ws + new
        if buf.strip():
            self._spoke = True
            self._held_ws = ""
            return buf
        self._held_ws = buf
        return ""


def parse_text(parser: ToolParser, text: str, parallel: bool = True) -> tuple[str | None, list[dict]]:
    """A finished text as (content or None, OpenAI tool_call objects): a stream of one piece,
    so that it says what any stream of the same text said (a call cut off before its end, by
    max_tokens or the model stopping, is a call with the arguments written so far, as OpenAI
    answers a call cut by finish_reason "length")."""
    stream = ToolCallStream(parser, parallel)
    content, _ = stream.push(text, final=True)
    return (content if stream.content_sent else None), stream.calls
