"""The boundary between the front end and the device side (docs/design.md, "Module map"):
``mindie/`` imports nothing of ``workers/``; ``workers/`` imports only ``mindie.contract`` (what
crosses the process boundary) and ``mindie.runtime`` (runtime code both sides share); those two
import only the standard library, msgspec and each other; front ends and the supervisor never
load torch. The coordinator (``coordinator/``) imports only the contract, the runtime and the
configuration of ``mindie/``, never the server's request stack, and loads neither a web framework
nor torch nor ZeroMQ at import."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import ROOT

STDLIB = set(sys.stdlib_module_names)


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a file under ``root``, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
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


def files(package: str, root: Path = ROOT) -> list[Path]:
    return sorted((root / package).rglob("*.py"))


def top(module: str) -> str:
    return module.split(".")[0]


def violations(package: str, allowed, root: Path = ROOT) -> list[str]:
    """``package``'s imports (its tree under ``root``: the repository, or a test's scratch copy)
    that ``allowed(path, module)`` refuses."""
    return [f"{p.relative_to(root)}:{line}: imports {m}" for p in files(package, root) for line, m in imports(p, root)
            if not allowed(p, m)]


def test_front_end_imports_nothing_of_workers() -> None:
    assert violations("mindie", lambda p, m: top(m) != "workers") == []


def test_server_and_workers_import_nothing_of_the_coordinator() -> None:
    """No arrow back up from the server's package or the device side to the coordinator, not
    even a lazy one (mindie-probe --coordinator finds its target through an entry point)."""
    assert violations("mindie", lambda p, m: top(m) != "coordinator") == []
    assert violations("workers", lambda p, m: top(m) != "coordinator") == []


SHARED = ("mindie.contract", "mindie.runtime")


def _shared(m: str) -> bool:
    return any(m == s or m.startswith(s + ".") for s in SHARED)


def test_workers_import_only_the_contract_and_runtime_of_mindie() -> None:
    assert violations("workers", lambda p, m: top(m) != "mindie" or _shared(m)) == []


def module_level_imports(path: Path) -> list[str]:
    """The modules a file imports at its top level (not inside a function or class)."""
    tree = ast.parse(path.read_text(), str(path))
    return [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names] + \
        [n.module or "" for n in tree.body if isinstance(n, ast.ImportFrom)]


def test_contract_and_runtime_import_only_stdlib_msgspec_and_themselves() -> None:
    allowed = STDLIB | {"msgspec", "__future__"}
    # The grammar a constraint compiles to (contract/grammar.py, one text for the front end's
    # check and the worker's compile) is llguidance's: imported inside ``grammar_text`` only, so
    # the contract loads without it.
    grammar = ROOT / "mindie" / "contract" / "grammar.py"
    assert violations("mindie/contract", lambda p, m: top(m) in allowed or _shared(m)
                      or (p == grammar and top(m) == "llguidance")) == []
    assert [m for m in module_level_imports(grammar) if top(m) == "llguidance"] == []
    # The planes' TLS (runtime/tls.py, shared by the front ends and the coordinator) reads
    # certificates with ``cryptography``, lazily: a device worker never loads it.
    tls = ROOT / "mindie" / "runtime" / "tls.py"
    assert violations("mindie/runtime", lambda p, m: top(m) in allowed or _shared(m)
                      or (p == tls and top(m) == "cryptography")) == []


def test_the_scan_sees_a_violation(tmp_path: Path) -> None:
    """The scanner itself: an import it must flag is flagged (relative forms included). The probe
    lives in a scratch tree: one written into the repository would be seen by the other scans of
    the tree that run beside this test (tests/test_design_map.py, the boundary checks above)."""
    probe = tmp_path / "mindie" / "_boundary_probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("from workers.engine import engine\nfrom ..workers import spec\nimport workers\n")
    bad = violations("mindie", lambda p, m: top(m) != "workers", root=tmp_path)
    assert len(bad) == 3, bad


# What the coordinator may import of the server's package: the contract, the runtime, the configuration.
COORDINATOR_MAY_IMPORT = ("mindie.contract", "mindie.runtime", "mindie.config")


def imported_names(path: Path) -> list[tuple[int, str]]:
    """Like ``imports``, with each name of a ``from X import a, b`` as ``X.a``, ``X.b`` (so that
    ``from mindie import sse`` is seen as ``mindie.sse``)."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return out


# The fleet launcher (coordinator/fleet/, scripts/motor.sh: a process of its own that starts server
# instances) also waits for them with the server's own probe client, as their health checks do; the
# coordinator's own health probe (coordinator/probe.py) is that client with the coordinator's target.
FLEET_PROBE = "mindie.ops.probe"


def _uses_probe(p: Path, root: Path = ROOT) -> bool:
    rel = p.relative_to(root).parts
    return "fleet" in rel or rel == ("coordinator", "probe.py")


def coordinator_violations(root: Path = ROOT) -> list[str]:
    def ok(p: Path, m: str) -> bool:
        allowed = COORDINATOR_MAY_IMPORT + ((FLEET_PROBE,) if _uses_probe(p, root) else ())
        return top(m) != "mindie" or any(m == s or m.startswith(s + ".") for s in allowed)
    return [f"{p.relative_to(root)}:{line}: imports {m}" for p in files("coordinator", root)
            for line, m in imported_names(p) if not ok(p, m)]


def test_coordinator_imports_only_the_contract_runtime_and_config_of_mindie() -> None:
    assert coordinator_violations() == []


def test_the_coordinator_scan_sees_a_violation(tmp_path: Path) -> None:
    """The coordinator's scan itself: the imports it must flag are flagged, allowed ones are not
    (the probe in a scratch tree, as test_the_scan_sees_a_violation's)."""
    probe = tmp_path / "coordinator" / "_boundary_probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("from mindie.api.openai import error_payload\nfrom mindie import sse\nimport mindie.errors\n"
                     "from mindie.contract import families\nfrom mindie import config\n"
                     "def f():\n    import mindie.text.structured\n")
    bad = [v for v in coordinator_violations(tmp_path) if v.startswith(str(probe.relative_to(tmp_path)))]
    assert [v.rsplit(" ", 1)[1] for v in bad] == ["mindie.api.openai.error_payload", "mindie.sse", "mindie.errors",
                                                  "mindie.text.structured"], bad


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


def test_the_coordinator_loads_no_server_stack() -> None:
    """``import coordinator.app`` and the console script's module load no web framework, torch,
    ZeroMQ, nor the server's request stack. One exception: the configuration (mindie.config)
    checks ModelConfig's tool-call parser names against ``mindie.text.tool_parsers.names``, a
    dependency-free table in a package that imports nothing itself."""
    code = BLOCK_TORCH + "import coordinator.app, coordinator.cli\n" + (
        "allowed = {'mindie.text', 'mindie.text.tool_parsers', 'mindie.text.tool_parsers.names'}\n"
        "banned = ('falcon', 'torch', 'zmq', 'mindie.api', 'mindie.text', 'mindie.server', 'mindie.pipeline',\n"
        "          'mindie.sse', 'mindie.api.infer_responses', 'mindie.device_client', 'workers')\n"
        "loaded = sorted(m for m, mod in sys.modules.items() if mod is not None and m not in allowed\n"
        "                and any(m == b or m.startswith(b + '.') for b in banned))\n"
        "assert not loaded, loaded\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_mindie_probe_finds_the_coordinator_through_its_entry_point(tmp_path) -> None:
    """``mindie-probe --coordinator`` (the installed console script) reaches the coordinator's
    resolver through the ``mindie.probe_targets`` entry point declared in setup.cfg: a config
    error it raises is the coordinator loader's, named by key."""
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    group = cfg["options.entry_points"]["mindie.probe_targets"]
    assert "coordinator = coordinator.probe:coordinator_target" in group
    from mindie.ops import probe
    bad = tmp_path / "ms_coordinator.json"
    bad.write_text('{"http_config": {"manage_port": "x"}}')
    code, line = probe.run(["--coordinator", "--config", str(bad), "readiness"])  # the installed entry point
    assert code == probe.USAGE and "manage_port" in line, line
