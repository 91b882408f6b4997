"""Request fields a route ignores: found, named to the client, logged rate-limited.

Every API family accepts a body with keys it does not read and answers as if they were absent
(MindIE's /infer, TGI and vLLM do; a ``max_new_token`` typo then silently means the default 20
tokens). This module makes that visible the way vLLM does ("The following fields were present in
the request but ignored: ..."), without changing what is accepted:

- ``find`` lists the keys of a decoded body that its family's ``Schema`` does not know, as
  dotted paths (``parameters.max_new_token``, ``inputs[0].parametrs``), nested objects included;
  a key whose value is null is not listed (null asks for the default, which is what happens);
- ``header_value`` names them in the ``X-Ignored-Fields`` response header (at most
  ``MAX_NAMES``, percent-encoded so that any key is a safe header token);
- ``IgnoredFieldsLog.report`` logs a WARNING naming them with the closest known key ("did you
  mean max_new_tokens?", ``difflib``), once per (route, field set) per ``window_s`` in each
  front end, with the count of repeats it did not log.

mindie/pipeline.py reports what a codec's ``Job.ignored`` holds; docs/apis.md has each family's
rules.
"""
from __future__ import annotations

import difflib
import logging
import time
import typing
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional, Union
from urllib.parse import quote

import msgspec

HEADER = "X-Ignored-Fields"
MAX_NAMES = 16  # names in the header and the log line; the rest are counted
MAX_NAME_CHARS = 128  # a longer name is cut (percent-encoded form)
WINDOW_S = 60.0
MAX_TRACKED = 1024  # distinct (route, field set) pairs remembered for rate limiting

# The keys a family reads at one level of its body: a key maps to None (not looked into) or to
# the schema of its value (an object, or a list of objects).
Schema = Mapping[str, Optional["Schema"]]

# One ignored field: its dotted path and the schema of its level (for suggestions).
Found = tuple[str, Schema]

log = logging.getLogger("mindie.api")


def find(value: Any, schema: Schema, prefix: str = "") -> list[Found]:
    """The keys of ``value`` (a decoded JSON object) that ``schema`` does not know, recursing
    into known keys whose schema is given (an object, or each object of a list)."""
    out: list[Found] = []
    if type(value) is not dict:
        return out
    for k, v in value.items():
        if k in schema:
            sub = schema[k]
            if sub is None or v is None:
                continue
            if type(v) is dict:
                out += find(v, sub, f"{prefix}{k}.")
            elif type(v) is list:
                for i, item in enumerate(v):
                    if type(item) is dict:
                        out += find(item, sub, f"{prefix}{k}[{i}].")
        elif v is not None:
            out.append((prefix + k, schema))
    return out


def find_in_json(body: bytes, schema: Schema) -> list[Found]:
    """``find`` on a JSON body without building its values: each level is decoded as raw
    slices, and only the objects the schema looks into are decoded further (for a family whose
    parser never builds a dict of the body). Not JSON, or not an object: nothing."""
    try:
        top = _raw_object.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return []
    return _find_raw(top, schema, "")


_raw_object = msgspec.json.Decoder(dict[str, msgspec.Raw])
_raw_array = msgspec.json.Decoder(list[msgspec.Raw])
_NULL = msgspec.Raw(b"null")


def _find_raw(obj: dict[str, msgspec.Raw], schema: Schema, prefix: str) -> list[Found]:
    out: list[Found] = []
    for k, raw in obj.items():
        if k not in schema:
            if raw != _NULL:
                out.append((prefix + k, schema))
            continue
        sub = schema[k]
        if sub is None:
            continue
        head = memoryview(raw)[:1]  # no copy of the value unless it is looked into
        try:
            if head == b"{":
                out += _find_raw(_raw_object.decode(raw), sub, f"{prefix}{k}.")
            elif head == b"[":
                for i, item in enumerate(_raw_array.decode(raw)):
                    if memoryview(item)[:1] == b"{":
                        out += _find_raw(_raw_object.decode(item), sub, f"{prefix}{k}[{i}].")
        except (msgspec.DecodeError, RecursionError):
            continue
    return out


def struct_schema(cls: type) -> dict[str, Any]:
    """The schema of a msgspec Struct: its fields' JSON names; a field whose type is (or holds,
    as Optional or a list) another Struct maps to that Struct's schema."""
    schema: dict[str, Any] = {}
    for f in msgspec.structs.fields(cls):
        nested = _struct_in(f.type)
        schema[f.encode_name] = struct_schema(nested) if nested is not None else None
    return schema


def _struct_in(tp: Any) -> type | None:
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _struct_in(typing.get_args(tp)[0])
    if origin is Union or origin is list:
        for arg in typing.get_args(tp):
            found = _struct_in(arg)
            if found is not None:
                return found
        return None
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    return None


def safe_name(path: str) -> str:
    """A field path as a header token and a log word: anything but letters, digits and
    ``._-~[]`` percent-encoded (no comma, space, quote or control character survives), cut to
    ``MAX_NAME_CHARS``."""
    s = quote(path, safe="._-~[]")
    return s if len(s) <= MAX_NAME_CHARS else s[:MAX_NAME_CHARS] + "..."


def header_value(found: list[Found]) -> str:
    """The ``X-Ignored-Fields`` value: the first ``MAX_NAMES`` paths, ``, ``-separated, then
    ``...`` when there are more."""
    names = [safe_name(p) for p, _ in found[:MAX_NAMES]]
    if len(found) > MAX_NAMES:
        names.append("...")
    return ", ".join(names)


def suggestion(path: str, level: Schema) -> str | None:
    """The known key closest to the last name of ``path`` at its level (case-insensitive,
    ``difflib``), else the closest one level down, with its path (``max_new_token`` at the top of
    an /infer body: ``parameters.max_new_tokens``); None when nothing is close."""
    name = path.rpartition(".")[2]
    name = (name.rpartition("]")[2] or name).lower()
    here = {k.lower(): k for k in level}
    below = {inner.lower(): f"{k}.{inner}" for k, sub in level.items() if sub is not None for inner in sub}
    for names in (here, below):
        close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.75)
        if close:
            return names[close[0]]
    return None


class IgnoredFieldsLog:
    """The rate-limited WARNING about ignored fields, one per front-end process."""

    def __init__(self, logger: logging.Logger = log, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic, max_tracked: int = MAX_TRACKED):
        self.logger = logger
        self.window_s = window_s
        self.clock = clock
        self.max_tracked = max_tracked
        # (route, names) -> [time of the last line logged, repeats not logged since]
        self._seen: OrderedDict[tuple[str, tuple[str, ...]], list] = OrderedDict()

    def report(self, route: str, found: list[Found]) -> bool:
        """Log the fields ``route`` ignored unless the same set was logged for it within the
        window (then count the repeat); returns whether a line was logged."""
        if not found:
            return False
        names = tuple(sorted(p for p, _ in found[:MAX_NAMES]))
        key = (route, names)
        now = self.clock()
        entry = self._seen.get(key)
        if entry is not None and now - entry[0] < self.window_s:
            entry[1] += 1
            return False
        repeats = entry[1] if entry is not None else 0
        self._seen[key] = [now, 0]
        self._seen.move_to_end(key)
        self._forget(now)
        self.logger.warning("%s: the following fields were present in the request but ignored: %s%s%s",
                            quote(route, safe="/ ._-~[]{}"), _describe(found[:MAX_NAMES]),
                            f" (and {len(found) - MAX_NAMES} more)" if len(found) > MAX_NAMES else "",
                            f"; {repeats} more requests with these fields in the last {self.window_s:g} s "
                            "were not logged" if repeats else "")
        return True

    def _forget(self, now: float) -> None:
        """Drop the oldest pairs whose window has passed with no repeat to tell, and any beyond
        ``max_tracked`` (their repeats untold), so random keys cannot grow the table."""
        seen = self._seen
        while seen:
            key, (t, repeats) = next(iter(seen.items()))
            if len(seen) > self.max_tracked or (now - t >= self.window_s and not repeats):
                del seen[key]
                continue
            break


def _describe(found: Iterable[Found]) -> str:
    parts = []
    for path, level in found:
        close = suggestion(path, level)
        parts.append(f"{safe_name(path)} (did you mean {safe_name(close)}?)" if close else safe_name(path))
    return ", ".join(parts)


REPORTER = IgnoredFieldsLog()  # this process's


def report(req: Any, resp: Any, found: list[Found], reporter: IgnoredFieldsLog | None = None) -> None:
    """Name ``found`` in ``resp``'s header and log it (rate-limited) for ``req``'s route."""
    if not found:
        return
    resp.set_header(HEADER, header_value(found))
    (reporter or REPORTER).report(f"{req.method} {req.path}", found)
