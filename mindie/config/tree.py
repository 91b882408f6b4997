"""A config's key tree: raw JSON walked against msgspec Struct types by JSON key.

Generic over the root type (the server's ``Config``, the coordinator's ``CoordinatorConfig``):
the keys a file holds that are not fields (``keys_outside``), every field's dotted key
(``key_templates``: list indices written "[]", a mapping's own keys ``MAPPING_KEY``), and a dotted
key's value and declared type (``lookup``).
"""
from __future__ import annotations

import re
import typing
from typing import Annotated, Any, Union

import msgspec

MAPPING_KEY = "<model_type>"  # a mapping's own keys in a key template (ModelConfig[].models.<model_type>)


def unwrap(tp: Any) -> Any:
    """``tp`` without its ``Annotated`` layers."""
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def struct_fields(tp: Any) -> dict[str, Any]:
    """{JSON key: type} of a Struct, or {} for anything else."""
    tp = unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return {f.encode_name: f.type for f in msgspec.structs.fields(tp)}
    return {}


def keys_outside(raw: Any, tp: Any, path: str = "") -> list[str]:
    """The dotted keys of ``raw`` that are not fields of ``tp`` (nor below one), in file order;
    keys starting "//" are comments (JSON has none: deploy/config.example.json explains itself so)."""
    out: list[str] = []
    tp = unwrap(tp)
    if (fields := struct_fields(tp)) and isinstance(raw, dict):
        for key, value in raw.items():
            sub = f"{path}.{key}" if path else key
            if key.startswith("//"):
                continue
            if key in fields:
                out += keys_outside(value, fields[key], sub)
            else:
                out.append(sub)
    elif typing.get_origin(tp) is list and isinstance(raw, list):
        (elem,) = typing.get_args(tp)
        for i, item in enumerate(raw):
            out += keys_outside(item, elem, f"{path}[{i}]")
    elif typing.get_origin(tp) is dict and isinstance(raw, dict):  # ModelConfig[].models.<model_type>
        for key, value in raw.items():
            out += keys_outside(value, typing.get_args(tp)[1], f"{path}.{key}")
    return out


def path_steps(path: str) -> list[tuple[str, str]]:
    """'A.B[0].c' -> [("A", ""), ("B", ""), ("", "0"), ("c", "")]: (key, "") or ("", list index)."""
    return re.findall(r"\.([^.\[]+)|\[(\d+)\]", "." + path)


def child_type(tp: Any, name: str) -> Any:
    """The declared type one step below ``tp``: its key ``name``'s (a mapping's values for any key),
    or with ``name`` "" its list elements'; Any where nothing is declared."""
    tp = unwrap(tp)
    if name:
        return typing.get_args(tp)[1] if typing.get_origin(tp) is dict else struct_fields(tp).get(name, Any)
    return typing.get_args(tp)[0] if typing.get_origin(tp) is list else Any


def lookup(raw: Any, path: str, root: Any) -> tuple[bool, Any, Any]:
    """(found, raw value, declared type) of a dotted JSON path such as 'A.B[0].c' below ``root``."""
    value, tp, found = raw, root, True
    for name, index in path_steps(path):
        tp = child_type(tp, name)
        if name:
            found = found and isinstance(value, dict) and name in value
            value = value[name] if found else None
        else:
            found = found and isinstance(value, list) and int(index) < len(value)
            value = value[int(index)] if found else None
    return found, value, unwrap(tp)


def key_templates(tp: Any, path: str = "") -> list[str]:
    """Every key of the Struct ``tp`` and below, as dotted paths: list indices written "[]", a
    mapping's own keys ``MAPPING_KEY`` (``ModelConfig[].models.<model_type>.chat_template``)."""
    out: list[str] = []
    for name, sub in struct_fields(tp).items():
        here = f"{path}.{name}" if path else name
        out += [here, *_templates_below(sub, here)]
    return out


def _templates_below(tp: Any, path: str) -> list[str]:
    tp = unwrap(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        return _templates_below(args[0], path + "[]")
    if origin is dict:
        return _templates_below(args[1], f"{path}.{MAPPING_KEY}")
    if origin is Union:
        return [t for a in args for t in _templates_below(a, path)]
    return key_templates(tp, path) if struct_fields(tp) else []
