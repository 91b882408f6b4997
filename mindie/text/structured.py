"""Structured output: every API's way of asking for constrained output, turned into one
``wire.Constraint``, and checked in the front end before anything is submitted.

Builders (each raises ``ConstraintError``, a 400 naming the field; the MindIE-validated routes
answer it as their 422 with the same message):

- ``from_response_format``: OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``
  with ``name``/``schema``/``strict``), with MindIE's checks and messages (infer_param.cpp
  ``AssignResponseFormat``), and TGI's spelling of it (``{"type": "json"|"json_object"|"regex"|
  "json_schema", "value": ...}``, what ``huggingface_hub`` sends to a TGI chat route);
- ``from_structured_outputs``: vLLM's ``structured_outputs`` object (``json``, ``regex``,
  ``choice``, ``grammar``, ``json_object``, ``structural_tag``; ``disable_any_whitespace``,
  ``disable_additional_properties``, ``whitespace_pattern``; ``disable_fallback`` read, no effect);
- ``from_guided``: vLLM's older top-level ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar`` (with ``guided_whitespace_pattern``; ``guided_decoding_backend`` read, no
  effect);
- ``from_tgi_grammar``: TGI's ``parameters.grammar`` (``{"type": "json"|"regex"|"json_schema",
  "value": ...}``);
- ``json_schema_constraint``, ``lark_constraint``, ``regex_constraint``, ``choice_constraint``:
  the same for code that builds a constraint itself (tool calls: a grammar from the tools'
  parameter schemas).

The same request gives the same ``Constraint`` through every API (a JSON schema is re-encoded
compactly, key order kept: property order is the order the output writes them), so the worker's
grammar cache (keyed by content) and seeded sampling give the same tokens whichever API asked.

JSON schema options travel inside the schema as llguidance's top-level ``"x-guidance"`` object
(``whitespace_flexible``, ``whitespace_pattern``): a ``json_schema`` spec compiles with
``LLMatcher.grammar_from_json_schema(spec, defaults=JSON_DEFAULTS)`` (compact JSON unless the
schema says otherwise) and no overrides, so what the schema says wins.

``Checker`` compiles the grammar the device worker will enforce (the contract's ``grammar_text``,
mindie/contract/grammar.py: one text for both sides) with llguidance against the served model's
tokenizer (``LLMatcher.validate_grammar``; special tokens a Lark grammar names are checked too) and caches
the verdict by content. The tokenizer is converted once per front end, on the first constrained
request (~0.3-0.5 s for 32k-49k vocabularies), on a worker thread; a check costs ~1 ms for a
small schema and ~15 ms for a 44 KB one, so the pipeline runs unknown constraints' checks off the
event loop (``Job.checks``) and known ones cost a dictionary lookup.
"""
from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from mindie.contract.grammar import ConstraintError, first_lines, grammar_text, parser_limits
from mindie.contract.http_error import ApiError, validation_error
from mindie.contract.wire import Constraint

__all__ = ["Checker", "from_response_format", "from_structured_outputs", "from_guided", "from_tgi_grammar",
           "json_schema_constraint", "lark_constraint", "regex_constraint", "choice_constraint", "one_of",
           "as_validation_error", "STRUCTURED_OUTPUTS_KEYS", "GUIDED_KEYS", "JSON_OBJECT"]

JSON_OBJECT = Constraint("json_object")
MAX_NAME = 64  # OpenAI's and MindIE's bound on response_format.json_schema.name
MAX_MESSAGE = 1000  # characters of a compiler message kept in an error
CACHE_SIZE = 512  # verdicts remembered per front end
TRIAL_TOKENS = 8  # steps of a new grammar followed in the front end before it is admitted (Checker._trial)

# vLLM's StructuredOutputsParams: the constraint keys (one of them) and the options.
_SO_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
STRUCTURED_OUTPUTS_KEYS = _SO_CONSTRAINTS + ("disable_fallback", "disable_any_whitespace",
                                             "disable_additional_properties", "whitespace_pattern")
GUIDED_KEYS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_whitespace_pattern",
               "guided_decoding_backend")


def as_validation_error(e: ConstraintError) -> ApiError:
    """A refusal on the routes MindIE validates (TGI, vLLM /generate): 422 with the message."""
    return validation_error(e.message)


# -- building ----------------------------------------------------------------------------------

def _json_value(value: Any, field: str) -> Any:
    """A value that may come as JSON text (vLLM's ``json``, TGI's ``value``)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as e:
            raise ConstraintError(f"{field} is not valid JSON: {e}", field) from None
    return value


def _no_extra_properties(schema: Any) -> None:
    """``additionalProperties: false`` on every object schema that declares ``properties`` and says
    nothing of extra keys (OpenAI's strict-mode rule, vLLM's ``disable_additional_properties``).
    ``allOf`` branches are left alone: there a branch's closed object would refuse the other
    branches' properties."""
    if isinstance(schema, list):
        for s in schema:
            _no_extra_properties(s)
        return
    if not isinstance(schema, dict):
        return
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema \
            and "patternProperties" not in schema and "allOf" not in schema:
        schema["additionalProperties"] = False
    for key in ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas"):
        sub = schema.get(key)
        if isinstance(sub, dict):
            for s in sub.values():
                _no_extra_properties(s)
    for key in ("items", "prefixItems", "anyOf", "oneOf", "additionalProperties", "contains", "not",
                "if", "then", "else"):
        if key in schema:
            _no_extra_properties(schema[key])


def json_schema_constraint(schema: Any, field: str, *, close_objects: bool = False,
                           whitespace_flexible: bool | None = None, whitespace_pattern: str | None = None
                           ) -> Constraint:
    """A JSON schema (a dict, or its JSON text) as a ``json_schema`` constraint. ``close_objects``:
    objects that declare properties take no others unless the schema says so; the whitespace
    options go into the schema's ``x-guidance``."""
    schema = _json_value(schema, field)
    if not isinstance(schema, dict):
        raise ConstraintError(f"{field} must be a JSON schema object, got {type(schema).__name__}.", field)
    if close_objects or whitespace_flexible is not None or whitespace_pattern is not None:
        schema = json.loads(json.dumps(schema))  # a private copy to edit
    if close_objects:
        _no_extra_properties(schema)
    if whitespace_flexible is not None or whitespace_pattern is not None:
        xg = schema.get("x-guidance")
        xg = dict(xg) if isinstance(xg, dict) else {}
        if whitespace_pattern is not None:
            xg["whitespace_pattern"] = whitespace_pattern
        elif whitespace_flexible is not None:
            xg["whitespace_flexible"] = whitespace_flexible
        schema["x-guidance"] = xg
    try:
        spec = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError as e:
        raise ConstraintError(f"{field} is not a JSON schema: {e}", field) from None
    return Constraint("json_schema", spec)


def regex_constraint(pattern: Any, field: str) -> Constraint:
    if not isinstance(pattern, str) or not pattern:
        raise ConstraintError(f"{field} must be a non-empty string (a regular expression).", field)
    return Constraint("regex", pattern)


def choice_constraint(choices: Any, field: str) -> Constraint:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ConstraintError(f"{field} must be a non-empty list of strings.", field)
    if not any(choices):
        raise ConstraintError(f"{field} must hold a non-empty string.", field)
    return Constraint("choice", json.dumps(choices, ensure_ascii=False, separators=(",", ":")))


def lark_constraint(grammar: Any, field: str) -> Constraint:
    """A context-free grammar: llama.cpp's GBNF when it defines rules with ``::=``, else Lark
    (llguidance's syntax)."""
    if not isinstance(grammar, str) or not grammar.strip():
        raise ConstraintError(f"{field} must be a non-empty string (a Lark or GBNF grammar).", field)
    return Constraint("gbnf" if "::=" in grammar else "lark", grammar)


def _structural_tag(value: Any, field: str, special: Callable[[str], bool] | None) -> Constraint:
    """vLLM's structural tag ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``:
    free text in which each trigger starts a tagged JSON object (llguidance's ``StructTag``,
    compiled to a Lark grammar)."""
    from llguidance import StructTag

    value = _json_value(value, field)
    if not isinstance(value, dict):
        raise ConstraintError(f"{field} must be an object with structures and triggers.", field)
    structures, triggers = value.get("structures"), value.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers \
            or not all(isinstance(t, str) and t for t in triggers):
        raise ConstraintError(f"{field} must have a non-empty list of structures and of triggers (strings).", field)
    tags = []
    for i, s in enumerate(structures):
        where = f"{field}.structures[{i}]"
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end", ""), str):
            raise ConstraintError(f"{where} must be an object with begin, schema and end.", field)
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ConstraintError(f"{where}.begin must start with one of the triggers.", field)
        schema = json.loads(json_schema_constraint(s.get("schema", {"type": "object"}), f"{where}.schema").spec)
        tags.append(StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s.get("end", "")))
    specials = [t for t in triggers if t.startswith("<") and t.endswith(">")]
    assume_special = bool(specials) and special is not None and all(special(t) for t in specials)
    return Constraint("lark", StructTag.to_grammar(tags, assume_special=assume_special))


def from_response_format(rf: Any, field: str = "response_format",
                         special: Callable[[str], bool] | None = None) -> Constraint | None:
    """OpenAI's ``response_format`` (a decoded object; None: absent) as a constraint, None for
    ``text``. ``json_schema.strict: true`` closes the schema's objects (``additionalProperties:
    false`` where it declares properties and says nothing else); without it extra keys are allowed
    where JSON Schema allows them. TGI's ``{"type", "value"}`` form is taken too."""
    if rf is None:
        return None
    if not isinstance(rf, Mapping):
        raise ConstraintError("Parameter response_format must be an object", field)
    kind = rf.get("type")
    if kind is None:
        raise ConstraintError("Parameter response_format must contain 'type' field", field)
    if not isinstance(kind, str):
        raise ConstraintError("Parameter response_format.type must be a string", field)
    value = rf.get("value")
    if kind == "text":
        return None
    if kind in ("json_object", "json"):
        if value is not None:  # TGI: "json" (alias "json_object") carries the schema in "value"
            return json_schema_constraint(value, f"{field}.value")
        if kind == "json":
            raise ConstraintError("Parameter response_format.value is required when type is 'json'", field)
        return JSON_OBJECT
    if kind == "regex":  # TGI
        return regex_constraint(value, f"{field}.value")
    if kind == "structural_tag":  # vLLM
        return _structural_tag(rf, field, special)
    if kind != "json_schema":
        raise ConstraintError("Parameter response_format.type must be 'json_object', 'json_schema' or 'text', "
                              f"got '{kind}'", field)
    js = rf.get("json_schema")
    if js is None and isinstance(value, Mapping):  # TGI: {"type": "json_schema", "value": {"name", "schema"}}
        return json_schema_constraint(value.get("schema"), f"{field}.value.schema")
    if js is None:
        raise ConstraintError("Parameter response_format.json_schema is required when type is 'json_schema'", field)
    if not isinstance(js, Mapping):
        raise ConstraintError("Parameter response_format.json_schema must be an object", field)
    name = js.get("name")
    if name is None:
        raise ConstraintError("Parameter response_format.json_schema.name is required", field)
    if not isinstance(name, str):
        raise ConstraintError("Parameter response_format.json_schema.name must be a string", field)
    if not 1 <= len(name) <= MAX_NAME:
        raise ConstraintError(f"Parameter response_format.json_schema.name must be 1-{MAX_NAME} characters", field)
    schema = js.get("schema")
    if schema is None:
        raise ConstraintError("Parameter response_format.json_schema.schema is required when type is 'json_schema'",
                              field)
    if not isinstance(schema, Mapping):
        raise ConstraintError("Parameter response_format.json_schema.schema must be an object", field)
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ConstraintError("Parameter response_format.json_schema.strict must be a boolean", field)
    return json_schema_constraint(dict(schema), f"{field}.json_schema.schema", close_objects=bool(strict))


def from_structured_outputs(so: Any, field: str = "structured_outputs",
                            special: Callable[[str], bool] | None = None) -> Constraint | None:
    """vLLM's ``structured_outputs`` object (None: absent). Exactly one of its constraint keys."""
    if so is None:
        return None
    if not isinstance(so, Mapping):
        raise ConstraintError(f"{field} must be an object.", field)
    given = [k for k in _SO_CONSTRAINTS if so.get(k) is not None]
    if len(given) > 1:
        raise ConstraintError(f"You can only use one kind of structured outputs constraint but multiple are "
                              f"specified: {', '.join(given)}.", field)
    if not given:
        raise ConstraintError(f"You must use one kind of structured outputs constraint but none is specified "
                              f"({', '.join(_SO_CONSTRAINTS)}).", field)
    key = given[0]
    value = so[key]
    for opt in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
        if so.get(opt) is not None and not isinstance(so[opt], bool):
            raise ConstraintError(f"{field}.{opt} must be a boolean.", field)
    pattern = so.get("whitespace_pattern")
    if pattern is not None and (not isinstance(pattern, str) or not pattern):
        raise ConstraintError(f"{field}.whitespace_pattern must be a non-empty string.", field)
    flexible = False if so.get("disable_any_whitespace") else None
    if key == "json":
        return json_schema_constraint(value, f"{field}.json", close_objects=bool(so.get("disable_additional_properties")),
                                      whitespace_flexible=flexible, whitespace_pattern=pattern)
    if key == "json_object":
        if not isinstance(value, bool):
            raise ConstraintError(f"{field}.json_object must be a boolean.", field)
        if not value:
            raise ConstraintError(f"{field}.json_object must be true when given.", field)
        if flexible is None and pattern is None:
            return JSON_OBJECT
        return json_schema_constraint({"type": "object"}, f"{field}.json_object", whitespace_flexible=flexible,
                                      whitespace_pattern=pattern)
    if key == "regex":
        return regex_constraint(value, f"{field}.regex")
    if key == "choice":
        return choice_constraint(value, f"{field}.choice")
    if key == "grammar":
        return lark_constraint(value, f"{field}.grammar")
    return _structural_tag(value, f"{field}.structural_tag", special)


def from_guided(body: Mapping[str, Any]) -> tuple[Constraint | None, str]:
    """vLLM's older top-level ``guided_*`` keys of a decoded body: (the constraint or None, the
    field that gave it)."""
    given = [k for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar") if body.get(k) is not None]
    if len(given) > 1:
        raise ConstraintError(f"You can only use one kind of guided decoding but multiple are specified: "
                              f"{', '.join(given)}.", given[1])
    pattern = body.get("guided_whitespace_pattern")
    if pattern is not None and (not isinstance(pattern, str) or not pattern):
        raise ConstraintError("guided_whitespace_pattern must be a non-empty string.", "guided_whitespace_pattern")
    backend = body.get("guided_decoding_backend")
    if backend is not None and not isinstance(backend, str):
        raise ConstraintError("guided_decoding_backend must be a string.", "guided_decoding_backend")
    if not given:
        return None, ""
    key = given[0]
    value = body[key]
    if key == "guided_json":
        return json_schema_constraint(value, key, whitespace_pattern=pattern), key
    if key == "guided_regex":
        return regex_constraint(value, key), key
    if key == "guided_choice":
        return choice_constraint(value, key), key
    return lark_constraint(value, key), key


def from_tgi_grammar(grammar: Any, field: str = "grammar") -> Constraint | None:
    """TGI's ``grammar`` parameter: ``{"type": "json" (or "json_object"), "value": schema or its
    JSON text}``, ``{"type": "regex", "value": pattern}``, ``{"type": "json_schema", "value":
    {"name", "schema"}}``. None: absent."""
    if grammar is None:
        return None
    if not isinstance(grammar, Mapping) or not isinstance(grammar.get("type"), str):
        raise ConstraintError(f"{field} must be an object with a string type ('json', 'regex' or 'json_schema') "
                              "and a value.", field)
    kind, value = grammar["type"], grammar.get("value")
    if value is None:
        raise ConstraintError(f"{field}.value is required.", field)
    if kind in ("json", "json_object"):
        return json_schema_constraint(value, f"{field}.value")
    if kind == "regex":
        return regex_constraint(value, f"{field}.value")
    if kind == "json_schema":
        if not isinstance(value, Mapping):
            raise ConstraintError(f"{field}.value must be an object with a schema when type is 'json_schema'.", field)
        return json_schema_constraint(value.get("schema"), f"{field}.value.schema")
    raise ConstraintError(f"{field}.type must be 'json', 'regex' or 'json_schema', got '{kind}'.", field)


def one_of(*given: tuple[Constraint | None, str]) -> tuple[Constraint | None, str]:
    """The one constraint a request gives among its fields ((constraint, field) pairs); two are
    refused (vLLM refuses two kinds too), naming the second field."""
    found = [(c, f) for c, f in given if c is not None]
    if len(found) > 1:
        raise ConstraintError(f"Only one way of constraining the output may be used; this request gives "
                              f"{found[0][1]} and {found[1][1]}.", found[1][1])
    return found[0] if found else (None, "")


# -- checking ----------------------------------------------------------------------------------

class Checker:
    """Compiles constraints with llguidance against the served model's tokenizer (a front end's
    one ``tokenizers.Tokenizer``, converted on first use) and remembers each verdict."""

    def __init__(self, tokenizer: Any | None = None):
        """``tokenizer``: a ``tokenizers.Tokenizer`` (or anything with ``.tokenizer`` holding
        one, as mindie.text.detokenizer.TextTokenizer); None: checks without one (special tokens a
        grammar names are then not checked)."""
        self._source = getattr(tokenizer, "tokenizer", tokenizer)
        self._ll: Any = None
        self._lock = threading.Lock()
        self._verdicts: OrderedDict[Constraint, str] = OrderedDict()  # "" = valid, else the message
        self._added_map: dict[str, int] | None = None

    def ll_tokenizer(self) -> Any:
        """The model's llguidance tokenizer (built once; ~0.3-0.5 s for a 32k-49k vocabulary)."""
        if self._ll is None and self._source is not None:
            with self._lock:
                if self._ll is None:
                    from llguidance import LLTokenizer

                    self._ll = LLTokenizer(self._source.to_str())
        return self._ll

    def is_special(self, text: str) -> bool:
        """Whether ``text`` is one added token of the model (for structural tags' triggers).
        llguidance treats every added token as special, ``"special": false`` ones too (Qwen3's
        ``<think>``, ``<tool_call>``): it matches them only as tokens, never as text."""
        return self._added().get(text) is not None

    def _added(self) -> dict[str, int]:
        """The model's added tokens of two characters or more, text -> id (built once)."""
        if self._added_map is None:
            added = {} if self._source is None else self._source.get_added_tokens_decoder()
            self._added_map = {t.content: i for i, t in added.items() if len(t.content) >= 2}
        return self._added_map

    def _token_written_as_text(self, c: Constraint) -> str | None:
        """Why ``c`` cannot be followed, or None: a regex, a grammar's string or regex literal, or
        a choice that writes the text of one of the model's special tokens. llguidance matches a
        special token only as that token, yet where such a text is forced its mask admits the token
        (the tokenizer's own tokenisation of the forced text) and its parser then refuses it, so
        generation would fail midway (outlines#1771 is the same defect); refused up front instead.
        A Lark grammar names the token itself (``<|im_end|>``), which works."""
        if c.kind not in ("regex", "lark", "gbnf", "choice") or not self._added():
            return None
        # Added tokens that are not special (Qwen3's <think>) are written as text: the worker's
        # llguidance tokenizer never tokenizes text into one (workers/engine/constraints.py).
        ll, decoder = self.ll_tokenizer(), self._source.get_added_tokens_decoder()
        added = {t: i for t, i in self._added().items()
                 if decoder[i].special and i < ll.vocab_size and ll.is_special_token(i)}
        if c.kind == "regex":
            texts = [_unescape(c.spec)]
        elif c.kind == "choice":
            texts = json.loads(c.spec)
        else:
            try:
                from llguidance.gbnf_to_lark import any_to_lark

                lark = any_to_lark(c.spec) if c.kind == "gbnf" else c.spec
            except Exception:  # noqa: BLE001 - the compile step reports it
                return None
            texts = [_unescape(m.group(0)[1:-1]) for m in _LARK_LEXEME.finditer(lark)
                     if m.group(0)[:1] in ('"', "/") and not m.group(0).startswith("//")]
        for text in texts:
            for tok, tid in added.items():
                if tok in text:
                    how = "a regular expression" if c.kind == "regex" else \
                        "a choice" if c.kind == "choice" else "a grammar's string or regex"
                    return (f"Invalid \0: {tok!r} is one token of the model (id {tid}), which the grammar engine "
                            f"matches only as that token, not as text written by {how}; in a Lark grammar "
                            f"(structured_outputs.grammar) name the token itself: {tok}")
        return None

    def known(self, c: Constraint, field: str) -> bool:
        """True when ``c`` compiled before; raises its ConstraintError when it failed before;
        False when it was never checked (``check`` it, off the event loop)."""
        verdict = self._verdicts.get(c)
        if verdict is None:
            return False
        if verdict:
            raise ConstraintError(verdict.replace("\0", field), field)
        return True

    def pending(self, c: Constraint, field: str,
                refuse: Callable[[ConstraintError], ApiError] | None = None) -> list[Callable[[], None]]:
        """What is left to check of ``c`` before it is submitted: nothing when it compiled before
        (raises when it failed before), else its ``check``, to run off the event loop
        (pipeline ``Job.checks``). ``refuse`` turns a refusal into the family's error (MindIE's
        validated routes: 422)."""
        try:
            if self.known(c, field):
                return []
        except ConstraintError as e:
            raise refuse(e) if refuse else e from None
        if refuse is None:
            return [functools.partial(self.check, c, field)]

        def check() -> None:
            try:
                self.check(c, field)
            except ConstraintError as e:
                raise refuse(e) from None
        return [check]

    def check(self, c: Constraint, field: str) -> None:
        """Compile ``c`` (may take milliseconds, the first call also converts the tokenizer);
        raises ConstraintError naming ``field`` when llguidance refuses it."""
        if self.known(c, field):
            return
        from llguidance import LLMatcher

        try:
            grammar = grammar_text(c)
        except ConstraintError as e:  # untrusted text: a GBNF grammar that does not convert, too long a spec
            failed, messages = True, [e.message]
        else:
            failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer(),
                                                                        limits=parser_limits())
        # The field goes in when the verdict is read ("\0"): the same constraint may come in
        # another field (guided_json, response_format, ...).
        verdict = f"Invalid \0: {_first(messages)}" if failed else (
            self._token_written_as_text(c) or self._trial(grammar) or "")
        failed = bool(verdict)
        with self._lock:
            self._verdicts[c] = verdict
            self._verdicts.move_to_end(c)
            while len(self._verdicts) > CACHE_SIZE:
                self._verdicts.popitem(last=False)
        if failed:
            raise ConstraintError(verdict.replace("\0", field), field)


    def _trial(self, grammar: str) -> str:
        """Why the worker could not follow ``grammar``, or "": its first ``TRIAL_TOKENS`` steps
        run here as the worker runs them (a matcher under the same limits, the mask, the forced
        tokens), each time taking the lowest token the mask allows. llguidance builds its parser
        lazily, so validation passes grammars whose first rows explode (hundreds of optional
        properties: a row past ``max_items_in_row``), that admit no output (a ``$ref`` cycle) or
        whose lexer runs out of fuel (``(a{1000}){1000}``): these fail within the first tokens,
        here in at most ~1 s, instead of in a batch."""
        tok = self.ll_tokenizer()
        if tok is None:
            return ""
        import numpy as np
        import llguidance.numpy as llg_np
        from llguidance import LLMatcher

        m = LLMatcher(tok, grammar, log_level=0, limits=parser_limits())
        row = llg_np.allocate_token_bitmask(1, tok.vocab_size)
        for _ in range(TRIAL_TOKENS):
            if m.is_error() or m.is_stopped():
                break
            llg_np.fill_next_token_bitmask(m, row)
            if m.is_error():
                break
            m.compute_ff_tokens()  # the worker's jump-forward hint: its own limit (step_max_items)
            allowed = np.flatnonzero(row.reshape(-1))
            if m.is_error() or not len(allowed):
                break
            word = int(row.reshape(-1)[allowed[0]]) & 0xFFFFFFFF
            m.consume_token(int(allowed[0]) * 32 + (word & -word).bit_length() - 1)
            if m.is_error() and "doesn't satisfy the grammar" in m.get_error():
                # The trial's own pick refused (a special token the mask let by, as a reasoning
                # model's <think>): not the grammar's fault, and the worker never picks blindly.
                return ""
        return f"Invalid \0: {_too_complex(m.get_error())}" if m.is_error() else ""


def _too_complex(error: str) -> str:
    """llguidance's error from following a grammar, as a client reads it: the cause in words, then
    llguidance's own first line (never its parser state)."""
    line = first_lines(error, 1)
    if line.startswith("NoExtension"):
        return "the grammar admits no output (a $ref that only refers to itself?)"
    if "items" in line:
        cause = "too many alternatives at one point (hundreds of optional properties in one object, or a recursion " \
                "that writes nothing)"
    elif "lexer" in line.lower():
        cause = "a regular expression too large to follow (nested repetition counts?)"
    else:
        cause = "the grammar cannot be followed"
    return f"the grammar is too complex to follow: {cause}; llguidance: {re.split(r'[;(]', line)[0].strip()}"


# A Lark grammar's lexemes, left to right: a comment, a string, a token reference (<think>,
# </think>, <[123]>), a regex literal; anything else one character at a time.
_LARK_LEXEME = re.compile(r'//[^\n]*|"(?:[^"\\\n]|\\.)*"|<[^\s<>"]+>|/(?:[^/\\\n]|\\.)+/|.', re.S)


def _unescape(text: str) -> str:
    r"""A regex's or a string's text with ``\<``-style escapes of punctuation undone (``\/`` is
    ``/``), so a token's text written with escapes is found too."""
    return re.sub(r"\\([^0-9A-Za-z])", r"\1", text)


def _first(messages: list[str]) -> str:
    text = (messages[0] if messages else "the grammar does not compile").strip()
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE] + "..."
