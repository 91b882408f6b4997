"""Typed reads of config.json values, shared by the model-config parsers (errors name the key)."""
from __future__ import annotations

from typing import Any, Callable, Mapping

ErrorFactory = Callable[[str, str], Exception]


def config_int(cfg: Mapping[str, Any], key: str, err: ErrorFactory, default: Any = None, *,
               minimum: int = 1, missing: str = "missing (required)") -> int:
    """``cfg[key]`` (or ``default``) as an integer >= ``minimum``; ``err(key, msg)`` otherwise.
    A bool is refused although Python counts it an int: ``true`` for a layer count is a typo."""
    v = cfg.get(key, default)
    if v is None:
        raise err(key, missing)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise err(key, f"must be an integer >= {minimum}, got {v!r}")
    return v


def config_bool(cfg: Mapping[str, Any], key: str, err: ErrorFactory, default: bool) -> bool:
    """``cfg[key]`` (``default`` when absent or null) as true/false; ``err(key, msg)`` otherwise."""
    v = cfg.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise err(key, f"must be true or false, got {v!r}")
    return v
