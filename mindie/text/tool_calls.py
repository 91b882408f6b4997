"""Tool calls on ``/v1/chat/completions`` (issue 29, docs/apis.md "Tool calls"): the request's
``tools``, ``tool_choice`` and ``parallel_tool_calls`` checked, the tools presented to the model,
``required`` and a named function turned into a grammar, and the history made renderable.

``ToolSupport`` is the served model's side, set up once per front end: its parser
(mindie/text/tool_parsers/), which of the parser's delimiters its tokenizer has as special tokens, and
what its chat template renders (found by rendering a probe conversation once):

- a template that renders ``tools`` (Qwen2.5, Llama 3.1, ...) presents them itself; one that does
  not (ChatML without tools, like SmolLM2's, and the demo model's) gets the parser's
  ``instructions`` (the tools as JSON lines and the call format) added to the system message,
  or as a system message of their own;
- assistant ``tool_calls`` and ``tool`` messages reach a template that renders them as
  transformers documents them (``function.arguments`` as a dict, not OpenAI's JSON string);
  for a template that does not, each call is written into the assistant's content in the
  parser's format and each tool result becomes a user turn (``<tool_response>...``), so the
  conversation still renders.

``ToolSupport.request`` reads one request into a ``ToolRequest``: the mode (``none``: tools go to
the template as vLLM does and the output is never parsed; ``auto``: the output is parsed;
``required`` / a named function: also a Lark grammar of the call in the model's own format, put
in ``SamplingParams.constraint`` for the device worker to enforce), or a 400 naming the field:
a tool that is not a function, a bad name, a name twice, parameters that are not a JSON schema
llguidance compiles (whatever tool_choice: the same tools must work under every choice), a
``tool_choice`` that names no tool of ``tools``, any ``tool_choice`` but ``none`` without tools.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance

from mindie.text.chat_template import ChatTemplate, ChatTemplateError
from mindie.contract.wire import Constraint
from mindie.text.detokenizer import TextTokenizer
from mindie.contract.http_error import ApiError
from mindie.text.tool_parsers import names
from mindie.text.tool_parsers.registry import PARSERS, ToolParser, detect, parser_class
from mindie.text.tool_parsers.base import NO_PARAMETERS, Function, lark_literal

log = logging.getLogger("mindie.tool_calls")

__all__ = ["ToolSupport", "ToolRequest", "check_tools", "configured_options"]

# OpenAI's rule for function names (it keeps every format's markup unambiguous too).
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_PROBE_TOOL, _PROBE_CALL, _PROBE_RESULT = "mindie_probe_tool_7f3a", "mindie_probe_call_7f3a", "mindie_probe_result_7f3a"


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param)


@functools.lru_cache(maxsize=512)
def _schema_error(schema_json: str) -> str:
    """llguidance's error for a JSON schema ("" = it compiles), cached by content."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_json)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if is_error and messages else ""


def _check_parameters(schema_json: str, name: str, where: str) -> None:
    err = _schema_error(schema_json)
    if err:
        raise _bad(f"Invalid schema for function {name!r} ({where}.function.parameters): {err}",
                   f"{where}.function.parameters")


def check_tools(tools: Any, checks: list[Callable[[], None]] | None = None) -> list[Function]:
    """The request's ``tools`` as Functions, or a 400 naming the field. ``checks``: where to leave
    the compiles of parameter schemas not seen before (run off the event loop, pipeline
    ``Job.checks``); None: compiled here."""
    if not isinstance(tools, list):
        raise _bad("tools must be a list of tools.", "tools")
    out: list[Function] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(f"{where} must be an object.", where)
        if tool.get("type", "function") != "function":
            raise _bad(f"{where}.type: only function tools are supported, got {tool.get('type')!r}.", f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function must be an object with a name.", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise _bad(f"{where}.function.name must be 1-64 letters, digits, underscores or dashes, got {name!r}.",
                       f"{where}.function.name")
        if name in seen:
            raise _bad(f"{where}.function.name: the function {name!r} is defined twice.", f"{where}.function.name")
        seen.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise _bad(f"{where}.function.description must be a string.", f"{where}.function.description")
        params = fn.get("parameters")
        if params is None:
            params = NO_PARAMETERS
        elif not isinstance(params, dict):
            raise _bad(f"{where}.function.parameters must be a JSON schema object.", f"{where}.function.parameters")
        else:
            check = functools.partial(_check_parameters, json.dumps(params, sort_keys=True), name, where)
            if checks is None:
                check()
            else:
                checks.append(check)
        out.append(Function(name, params, desc or "", tool))
    return out


@dataclass
class ToolRequest:
    """One request's tools, as the codec uses them."""

    mode: str  # "none" | "auto" | "required" | "function"
    functions: list[Function]
    parallel: bool  # parallel_tool_calls
    parser: ToolParser | None  # None: the output is not parsed (mode "none")
    constraint: Constraint | None = None  # required / a named function: the call's grammar
    keep_special: frozenset[int] = frozenset()  # special token ids the detokeniser keeps (delimiters)
    instructions: str = ""  # the system-prompt text presenting the tools, when the template does not


def configured_options(models: dict[str, Any], model_dir: str | os.PathLike[str]) -> tuple[str, str]:
    """(tool_call_parser, chat_template) of the ``ModelConfig[].models`` entry for the served
    checkpoint's ``model_type`` (its config.json), as MindIE picks it; ("", "") when none."""
    if not models:
        return "", ""
    model_type = ""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            model_type = str(json.load(f).get("model_type") or "")
    except (OSError, ValueError):
        pass
    entry = models.get(model_type)
    if entry is None:
        log.warning("ModelConfig[].models has entries for %s but the served model's model_type is %r: "
                    "they do not apply", sorted(models), model_type)
        return "", ""
    return entry.tool_call_options.tool_call_parser.strip(), entry.chat_template.strip()


class ToolSupport:
    """The served model's tool-call setup (see the module docstring)."""

    def __init__(self, template: ChatTemplate, tokenizer: TextTokenizer, configured: str = ""):
        if configured:
            self.parser_cls = parser_class(configured)
            self.source = f"configured ({configured})"
        else:
            found = self._detect(template)
            self.parser_cls = PARSERS[found or names.HERMES]
            self.source = "detected from the chat template" if found else "default"
        self.renders_tools, self.renders_calls = self._probe(template)
        tok = tokenizer.tokenizer
        # delimiter -> its token id: special tokens, and added ones a tokenizer does not mark special
        # (Qwen's <tool_call>): the grammar names that token, so the model writes the id it was
        # trained on, not the delimiter's text in pieces (the worker never spells an added token).
        self.special: dict[str, int] = {}
        added = tok.get_added_tokens_decoder()
        for m in self.parser_cls.markers:
            tid = tok.token_to_id(m)
            if tid is not None and (tid in tokenizer.special_ids or tid in added):
                self.special[m] = tid
        log.info("tool calls: parser %s (%s); chat template renders tools: %s, tool calls: %s; special delimiters: %s",
                 self.parser_cls.name, self.source, self.renders_tools, self.renders_calls,
                 self.special or "none")

    @staticmethod
    def _detect(template: ChatTemplate) -> str | None:
        for src in template.templates.values():
            found = detect(src)
            if found:
                return found
        return None

    @staticmethod
    def _probe(template: ChatTemplate) -> tuple[bool, bool]:
        tools = [{"type": "function", "function": {"name": _PROBE_TOOL, "description": "probe",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        user = {"role": "user", "content": "hi"}
        try:
            renders_tools = _PROBE_TOOL in template.render([user], tools=tools)
        except ChatTemplateError:
            renders_tools = False
        calls = [user, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_probe", "type": "function", "function": {"name": _PROBE_CALL, "arguments": {"x": 1}}}]},
                 {"role": "tool", "content": _PROBE_RESULT, "tool_call_id": "call_probe"}]
        try:
            out = template.render(calls, tools=tools)
            renders_calls = _PROBE_CALL in out and _PROBE_RESULT in out
        except ChatTemplateError:
            renders_calls = False
        return renders_tools, renders_calls

    def token(self, marker: str) -> str:
        """A delimiter in a grammar: its special token by id, else its text."""
        tid = self.special.get(marker)
        return f"<[{tid}]>" if tid is not None else lark_literal(marker)

    def request(self, tools: Any, tool_choice: Any, parallel_tool_calls: bool | None,
                checks: list[Callable[[], None]] | None = None) -> ToolRequest | None:
        """The request's tools (None: it has none and no tool_choice), or a 400. ``checks``: see
        ``check_tools``; the call grammar of required / a named function is compiled by the
        caller (mindie/text/structured.py ``Checker``, against the model's tokenizer)."""
        if tools is not None and not isinstance(tools, list):
            raise _bad("tools must be a list of tools.", "tools")
        if not tools:
            if tool_choice is not None and tool_choice != "none":
                raise _bad("When using `tool_choice`, `tools` must be set.", "tool_choice")
            return None
        functions = check_tools(tools, checks)
        parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
        choice = "auto" if tool_choice is None else tool_choice
        if isinstance(choice, str):
            if choice not in ("none", "auto", "required"):
                raise _bad(f"Invalid value for `tool_choice`: {choice!r}. Only \"none\", \"auto\", \"required\" or "
                           "a named function ({\"type\": \"function\", \"function\": {\"name\": ...}}) are supported.",
                           "tool_choice")
            mode, chosen = choice, functions
        elif isinstance(choice, dict):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise _bad("Invalid value for `tool_choice`: a named function is "
                           "{\"type\": \"function\", \"function\": {\"name\": \"my_function\"}}.", "tool_choice")
            chosen = [f for f in functions if f.name == name]
            if not chosen:
                raise _bad(f"tool_choice names the function {name!r}, which is not in tools "
                           f"({', '.join(f.name for f in functions)}).", "tool_choice")
            mode, parallel = "function", False
        else:
            raise _bad("tool_choice must be a string or an object.", "tool_choice")
        if mode == "none":
            return ToolRequest(mode, functions, parallel, None)
        parser = self.parser_cls([f.name for f in functions])
        treq = ToolRequest(mode, functions, parallel, parser, keep_special=frozenset(self.special.values()),
                           instructions="" if self.renders_tools else parser.instructions(functions))
        if mode in ("required", "function"):
            treq.constraint = Constraint("lark", parser.grammar(chosen, parallel, self.token))
        return treq

    def messages(self, messages: list[dict], treq: ToolRequest | None) -> list[dict]:
        """``messages`` as the chat template gets them (see the module docstring); a 400 for a
        call whose arguments are not JSON."""
        out: list[dict] = []
        parser = treq.parser if treq is not None and treq.parser is not None else self.parser_cls()
        for i, m in enumerate(messages):
            calls = m.get("tool_calls")
            if calls is not None:
                m = {**m, "tool_calls": _template_calls(calls, i)}
                if not self.renders_calls:
                    text = "\n".join(parser.render_call(c["function"]["name"], c["function"]["arguments"])
                                     for c in m["tool_calls"])
                    content = m.get("content") or ""
                    m = {k: v for k, v in m.items() if k != "tool_calls"}
                    m["content"] = f"{content}\n{text}" if content else text
            elif m.get("role") == "tool" and not self.renders_calls:
                result = parser.render_result(m.get("content") or "")
                if out and out[-1].get("_tool_results"):
                    out[-1]["content"] += "\n" + result
                    continue
                m = {"role": "user", "content": result, "_tool_results": True}
            out.append(m)
        for m in out:
            m.pop("_tool_results", None)
        if treq is not None and treq.instructions:
            if out and out[0].get("role") == "system":
                first = out[0].get("content") or ""
                out[0] = {**out[0], "content": f"{first}\n\n{treq.instructions}" if first else treq.instructions}
            else:
                out.insert(0, {"role": "system", "content": treq.instructions})
        return out


def _template_calls(calls: Any, i: int) -> list[dict]:
    """An assistant message's ``tool_calls`` with each ``function.arguments`` a JSON value (as
    chat templates expect), not OpenAI's JSON string."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise _bad(f"{where} must be a list.", "messages")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{where}[{j}] must be a function call with a name.", "messages")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise _bad(f"{where}[{j}].function.arguments is not valid JSON.", "messages") from None
        out.append({**c, "function": {**fn, "arguments": {} if args is None else args}})
    return out


def known_parsers() -> Sequence[str]:
    """Every name a config may give (for messages)."""
    return sorted(names.ALIASES)
