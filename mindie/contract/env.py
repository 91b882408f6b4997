"""On/off switches read from the environment, spelled the same way by every process."""
from __future__ import annotations

import os

OFF = ("0", "false", "no", "off")


def switched_off(name: str) -> bool:
    """Whether environment variable ``name`` turns its feature off (``0``, ``false``, ``no`` or
    ``off``, any case); unset or anything else leaves it on."""
    return os.environ.get(name, "").strip().lower() in OFF
