"""Where a config value came from, and the error that says so: ``ConfigError`` (``<dotted key>:
<what is wrong>``, then "(from launch.sh --port)", "(from environment variable X)" or "(in FILE)"),
``setting_source`` (a launch.sh flag, through MINDIE_SET_BY_FLAG, or an environment variable) and
``env_for`` (which override set a key)."""
from __future__ import annotations

import contextvars
import os
from typing import Mapping, Optional

# The environment load_config reads (its ``env``), for ConfigError's wording of where a value came from.
READING: contextvars.ContextVar[Optional[Mapping[str, str]]] = contextvars.ContextVar("READING", default=None)


def setting_source(var: str, env: Optional[Mapping[str, str]] = None) -> str:
    """Where a setting made by environment variable ``var`` came from, in words:
    "launch.sh --strict-config" when scripts/launch.sh set it from that flag (it lists what it set
    in MINDIE_SET_BY_FLAG, "VAR=--flag ...", the last one given last), else "environment variable
    VAR". ``env``: the environment load_config is reading, else the process's."""
    if env is None:
        env = READING.get() if READING.get() is not None else os.environ
    said = f"environment variable {var}"
    for item in env.get("MINDIE_SET_BY_FLAG", "").split():
        name, _, flag = item.partition("=")
        if name == var and flag:
            said = f"launch.sh {flag}"
    return said


class ConfigError(Exception):
    """A config problem, worded as ``<dotted key>: <what is wrong>`` (plus where the value came from)."""

    def __init__(self, message: str, key: Optional[str] = None, env: Optional[str] = None,
                 source: Optional[str] = None) -> None:
        text = f"{key}: {message}" if key else message
        if env:
            text += f" (from {setting_source(env)})"
        elif source:
            text += f" (in {source})"
        super().__init__(text)
        self.key = key
        self.env = env
        self.source = source
        self.unknown: list[tuple[str, Optional[str]]] = []  # a refusal's unknown keys (unknown_keys.refuse_unknown)


def env_for(key: str, from_env: Mapping[str, str]) -> Optional[str]:
    """The variable that set ``key`` or a key above it (npuDeviceIds covers npuDeviceIds[0][0]);
    ``from_env``: {dotted key: variable}, as the overrides were applied."""
    for k, name in from_env.items():
        if key == k or key.startswith((k + ".", k + "[")):
            return name
    return None
