"""The boundary between the front end and the device side (docs/design.md, "Module map"):
``mindie/`` imports nothing of ``workers/``; ``workers/`` imports only ``mindie.contract`` (what
crosses the process boundary) and ``mindie.runtime`` (runtime code both sides share); those two
import only the standard library, msgspec and each other; front ends and the supervisor never
load torch."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import ROOT

STDLIB = set(sys.stdlib_module_names)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((node.lineno, module))
    return out


def files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def top(module: str) -> str:
    return module.split(".")[0]


def violations(package: str, allowed) -> list[str]:
    return [f"{p.relative_to(ROOT)}:{line}: imports {m}" for p in files(package) for line, m in imports(p)
            if not allowed(p, m)]


def test_front_end_imports_nothing_of_workers() -> None:
    assert violations("mindie", lambda p, m: top(m) != "workers") == []


SHARED = ("mindie.contract", "mindie.runtime")


def _shared(m: str) -> bool:
    return any(m == s or m.startswith(s + ".") for s in SHARED)


def test_workers_import_only_the_contract_and_runtime_of_mindie() -> None:
    assert violations("workers", lambda p, m: top(m) != "mindie" or _shared(m)) == []


def test_contract_and_runtime_import_only_stdlib_msgspec_and_themselves() -> None:
    allowed = STDLIB | {"msgspec", "__future__"}
    assert violations("mindie/contract", lambda p, m: top(m) in allowed or _shared(m)) == []
    # The planes' TLS (runtime/tls.py, shared by the front ends and the coordinator) reads
    # certificates with ``cryptography``, lazily: a device worker never loads it.
    tls = ROOT / "mindie" / "runtime" / "tls.py"
    assert violations("mindie/runtime", lambda p, m: top(m) in allowed or _shared(m)
                      or (p == tls and top(m) == "cryptography")) == []


def test_the_scan_sees_a_violation(tmp_path: Path) -> None:
    """The scanner itself: an import it must flag is flagged (relative forms included)."""
    probe = ROOT / "mindie" / "_boundary_probe.py"
    probe.write_text("from workers.engine import engine\nfrom ..workers import spec\nimport workers\n")
    try:
        bad = violations("mindie", lambda p, m: top(m) != "workers")
    finally:
        probe.unlink()
    assert len(bad) == 3, bad


BLOCK_TORCH = "import sys; sys.modules['torch'] = None; sys.modules['torch_npu'] = None\n"


@pytest.mark.parametrize("modules,absent", [
    # A front end: the app and everything it builds on.
    (["mindie.server.app", "mindie.server.frontend", "mindie.device_client", "mindie.ops.launch_plan", "mindie.topology"], ["torch", "workers"]),
    # The supervisor: torch-free, and without the front end's asyncio client.
    (["workers.supervisor"], ["torch", "zmq.asyncio", "mindie.device_client", "mindie.config"]),
    # The device-side launch step: torch only for device detection or a shard plan (lazy there).
    (["workers.prepare"], ["torch"]),
])
def test_imports_without_torch(modules: list[str], absent: list[str]) -> None:
    code = BLOCK_TORCH + "".join(f"import {m}\n" for m in modules) + (
        "loaded = [m for m in %r if sys.modules.get(m) is not None]\n"
        "assert not loaded, loaded\n" % absent)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
