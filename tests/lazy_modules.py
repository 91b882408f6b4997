"""A test module's heavy client or reference package, imported on first use instead of at
collection: every xdist worker collects every test file, so a package imported at a test file's
top level (peft, anthropic, the agents SDK: seconds each) is paid by every worker, while only the
worker that runs the file needs it."""
from __future__ import annotations

import importlib
import importlib.util
import types

import pytest


class LazyModule:
    """Stands for module ``name`` and imports it on the first attribute read. Collection only asks
    for what the class itself answers (``__class__``, ``__module__``, ``__test__``), so it imports
    nothing."""

    __test__ = False  # pytest's test-object probe: answered here, not by importing the package

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: types.ModuleType | None = None

    def __getattr__(self, attr: str):
        if attr.startswith("_"):
            # Probes import nothing: dunders (copy, pickle, inspect) and private names, such as the
            # `_mock_name` pytest's fixture parsing reads off every module-level object (pytest 9),
            # which imported every lazy package at collection. Tests read public names only.
            raise AttributeError(attr)
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


def lazy_module(name: str) -> LazyModule | types.ModuleType:
    """``name`` imported on first use; where it is not installed, the test module is skipped at
    collection as ``pytest.importorskip`` does (the test extras install it)."""
    if importlib.util.find_spec(name.partition(".")[0]) is None:  # a submodule's spec imports its package
        return pytest.importorskip(name)
    return LazyModule(name)
