"""docs/design.md's module map names every module of mindie/, workers/ and coordinator/, and nothing else.

The map ("## Module map and the boundary") lists each module by its path from the repository root
(``mindie/pipeline.py``); a module added, moved or removed without its line in the map fails here.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mindie", "workers", "coordinator")


def _map_section() -> str:
    text = (ROOT / "docs" / "design.md").read_text()
    start = text.index("## Module map and the boundary")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def _modules() -> set[str]:
    out = set()
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            if p.name != "__init__.py" and "__pycache__" not in p.parts:
                out.add(p.relative_to(ROOT).as_posix())
    return out


def test_module_map_names_every_module():
    named = set(re.findall(r"\b((?:%s)/[\w/]+\.py)\b" % "|".join(PACKAGES), _map_section()))
    modules = _modules()
    assert not modules - named, f"modules missing from docs/design.md's module map: {sorted(modules - named)}"
    assert not named - modules, f"docs/design.md's module map names modules that do not exist: {sorted(named - modules)}"
