"""On/off switches read from the environment, spelled the same way by every process.

Every ``MINDIE_*`` variable a process reads is listed in the one table of docs/config.md
("Environment variables"), with the config key it overrides; the engine and kernel settings are
read only as overrides of their keys, by ``mindie.config`` (``ENV_OVERRIDES``), and reach the
workers through the launch plan. tests/test_env_table.py fails on a variable the table lacks.
"""
from __future__ import annotations

import os

OFF = ("0", "false", "no", "off")


def switched_off(name: str) -> bool:
    """Whether environment variable ``name`` turns its feature off (``0``, ``false``, ``no`` or
    ``off``, any case); unset or anything else leaves it on."""
    return os.environ.get(name, "").strip().lower() in OFF
