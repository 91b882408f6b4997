"""Structured output's grammar, one home for both sides: the text a ``wire.Constraint`` compiles
to (``grammar_text``: llguidance's grammar, what ``LLMatcher(tokenizer, grammar)`` takes), the
defaults it compiles with (``JSON_DEFAULTS``), the bounds both sides apply (``MAX_SPEC_CHARS``,
``PARSER_LIMITS``) and the one error of a constraint that cannot be
served (``ConstraintError``, a 400). The front end (mindie/text/structured.py) checks the very
grammar the device worker (workers/engine/constraints.py) then compiles and enforces, byte for byte.

llguidance is imported inside ``grammar_text`` only, so the contract still loads with the standard
library and msgspec alone (tests/test_boundary.py names this one exception).
"""
from __future__ import annotations

import json

from mindie.contract.http_error import ApiError
from mindie.contract.wire import CONSTRAINT_KINDS, Constraint

ERROR_STATUS = 400  # every constraint failure is the request's (MindIE's "Bad Request")
# JSON is generated compact (no whitespace outside strings) unless the schema's "x-guidance" says
# otherwise: free whitespace lets a weak model pad forever, and compact JSON is mostly forced text.
JSON_DEFAULTS = {"whitespace_flexible": False}
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # the schema of a ``json_object`` constraint
# The largest spec served (characters of a schema, regex, grammar or choice list): llguidance has
# no limit on a grammar's size before it builds it, and building grows faster than linearly (a
# 270 KB schema of 10,000 optional properties: 11 s of one core, then refused at the first mask).
MAX_SPEC_CHARS = 65536
# llguidance's parser limits (LLParserLimits), one set for the front end's trial and the worker's
# matchers, so a grammar the front end admits meets the same bounds in the worker. Its defaults
# bound lexer fuel, Earley items per row and per step, lexer states and grammar symbols;
# verbose_errors False keeps the parser's internal state out of the messages clients see.
PARSER_LIMITS: dict = {"verbose_errors": False}


def parser_limits():  # -> llguidance.LLParserLimits (imported here: see the module docstring)
    """A fresh ``LLParserLimits`` of ``PARSER_LIMITS``."""
    from llguidance import LLParserLimits

    return LLParserLimits(**PARSER_LIMITS)


class ConstraintError(ApiError):
    """A constraint that cannot be served: a 400 whose message names the constraint's kind or the
    request's field. ``field`` (the front end): the field that gave it, OpenAI's ``param`` is its
    top-level key (``field`` may be a path in it, which the message spells out); the device worker
    gives none."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(ERROR_STATUS, message, param=field.split(".", 1)[0].split("[", 1)[0] if field else None)


def first_lines(msg: str, n: int = 6) -> str:
    """llguidance's errors end with its parser state: keep the message and the source excerpt."""
    lines = []
    for ln in msg.strip().splitlines():
        if ln.startswith(("<state>", "<non-verbose/>")):  # the parser's state follows: never shown
            break
        if ln.strip():
            lines.append(ln)
    out = "\n".join(lines[:n])
    return out if len(out) < 1000 else out[:1000] + "..."


def grammar_text(c: Constraint) -> str:
    """llguidance's grammar for ``c`` (not yet checked against a tokenizer: compiling it reports
    most errors). Raises ``ConstraintError`` ("<kind> constraint: ...") for a spec that does not
    convert: not JSON, not a list of strings, a GBNF grammar that does not convert to Lark."""
    import llguidance
    from llguidance import LLMatcher

    kind, spec = c.kind, c.spec
    if kind not in CONSTRAINT_KINDS:
        raise ConstraintError(f"constraint kind {kind!r} is not one of {', '.join(CONSTRAINT_KINDS)}")
    if len(spec) > MAX_SPEC_CHARS:
        raise ConstraintError(f"{kind} constraint: the spec is {len(spec)} characters long; at most "
                              f"{MAX_SPEC_CHARS} are served")
    try:
        if kind == "json_schema":
            try:
                json.loads(spec)
            except ValueError as e:
                raise ConstraintError(f"json_schema constraint: the schema is not JSON: {e}") from None
            return LLMatcher.grammar_from_json_schema(spec, defaults=JSON_DEFAULTS)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema(JSON_OBJECT_SCHEMA, defaults=JSON_DEFAULTS)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            try:
                items = json.loads(spec)
            except ValueError as e:
                raise ConstraintError(f"choice constraint: the spec is not a JSON list: {e}") from None
            if not (isinstance(items, list) and items and all(isinstance(s, str) for s in items)):
                raise ConstraintError("choice constraint: the spec must be a non-empty JSON list of strings")
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in items))
        if kind == "lark":
            return LLMatcher.grammar_from_lark(spec)
        return llguidance.grammar_from("gbnf", spec)  # llguidance's GBNF -> Lark converter
    except ConstraintError:
        raise
    except Exception as e:  # noqa: BLE001  (the converters raise ValueError and friends)
        raise ConstraintError(f"{kind} constraint: {first_lines(str(e))}") from None
