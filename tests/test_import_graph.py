"""The shape of the project's import graph (tests/test_boundary.py says which side may import
what; this says how the modules of each side depend on each other).

Every import of every module of ``mindie/``, ``workers/`` and ``coordinator/`` counts, at module top or inside a
function (a lazy import is still a dependency), ``if TYPE_CHECKING`` ones included. Two rules:

- no import circles: every strongly connected component of the graph is a single module;
- ``workers/`` is layered (``LAYERS``, docs/design.md "Module map"): a module imports only
  modules of its own layer or of lower ones, never upwards. Every module of ``workers/`` has a
  layer, so a new module or package must be placed here.
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.harness import ROOT

PACKAGES = ("mindie", "workers", "coordinator")

# Lower numbers are imported by higher ones, never the reverse; the longest matching prefix
# decides. Kernels and model definitions know nothing of attention; attention (its KV cache
# included) knows nothing of the backends; the backends (device choice, the CPU's rewrites of a
# loaded model) know nothing of the engine; the engine (scheduler, runner, the assembly of both)
# nothing of the processes that run it.
LAYERS = {
    "mindie.contract": 0,
    "mindie.runtime": 0,
    "workers.settings": 0,  # this process's engine settings, read by every layer
    "workers.kernels": 1,
    "workers.models": 1,
    "workers.attention": 2,
    "workers.backends": 3,
    "workers.engine": 4,
}
# The process entry points (and the empty top package), above everything (exact names).
ENTRY_POINTS = {"workers": 5, "workers.worker": 5, "workers.tp_rank": 5, "workers.supervisor": 5, "workers.model_host": 5, "workers.model_memory": 5, "workers.pd_transfer": 5,
                "workers.prepare": 5}

# Known circles awaiting their fix, each with its reason (none: keep it that way).
KNOWN_CYCLES: list[frozenset[str]] = []


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_sources() -> dict[str, tuple[str, bool]]:
    """module name -> (source, is a package)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            out[module_name(path)] = (path.read_text(), path.name == "__init__.py")
    return out


def _resolve(name: str, modules: set[str]) -> str | None:
    """The project module ``name`` refers to: itself, or the longest prefix that is a module."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the project modules it imports (``from pkg import sub`` counts as ``pkg.sub``
    when that is a module)."""
    modules = set(sources)
    graph: dict[str, set[str]] = {}
    for mod, (source, is_package) in sources.items():
        package = mod if is_package else mod.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(source, mod)):
            if isinstance(node, ast.Import):
                targets.update(filter(None, (_resolve(a.name, modules) for a in node.names)))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base_name = ".".join(base + ([node.module] if node.module else []))
                else:
                    base_name = node.module or ""
                for alias in node.names:
                    sub = f"{base_name}.{alias.name}"
                    target = sub if sub in modules else _resolve(base_name, modules)
                    if target is not None:
                        targets.add(target)
        targets.discard(mod)
        graph[mod] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = set()
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    scc.add(m)
                    if m == node:
                        break
                if len(scc) > 1:
                    out.append(frozenset(scc))
    return out


def layer(module: str) -> int | None:
    if module in ENTRY_POINTS:
        return ENTRY_POINTS[module]
    best = None
    for prefix, n in LAYERS.items():
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, n)
    return None if best is None else best[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod in sorted(m for m in graph if m.split(".")[0] == "workers"):
        for target in sorted(graph[mod]):
            lt = layer(target)
            if lt is not None and lt > layer(mod):
                bad.append(f"{mod} (layer {layer(mod)}) imports {target} (layer {lt})")
    return bad


def test_every_workers_module_has_a_layer() -> None:
    assert [m for m in project_sources() if m.split(".")[0] == "workers" and layer(m) is None] == []


def test_no_import_cycles() -> None:
    found = cycles(import_graph(project_sources()))
    assert [sorted(c) for c in found if c not in KNOWN_CYCLES] == []


def test_workers_never_import_upwards() -> None:
    assert upward_imports(import_graph(project_sources())) == []


def test_the_checks_see_a_cycle_and_an_upward_import() -> None:
    """The checks themselves, on the real sources with three imports added: a lazy one from the
    attention package up to the engine, and two that close a circle (worker -> assembly ->
    worker; in the coordinator, app -> registry -> app)."""
    sources = project_sources()
    paged, _ = sources["workers.attention.paged"]
    sources["workers.attention.paged"] = (paged + "\n\ndef _probe():\n    from workers.engine.engine import Engine\n",
                                          False)
    assembly, _ = sources["workers.engine.assembly"]
    sources["workers.engine.assembly"] = (assembly + "\nfrom .. import worker\n", False)
    registry, _ = sources["coordinator.registry"]
    sources["coordinator.registry"] = (registry + "\nfrom coordinator import app\n", False)
    graph = import_graph(sources)
    assert "workers.attention.paged (layer 2) imports workers.engine.engine (layer 4)" in upward_imports(graph)
    assert any({"workers.worker", "workers.engine.assembly"} <= c for c in cycles(graph))
    assert any({"coordinator.app", "coordinator.registry"} <= c for c in cycles(graph))
    assert "workers.engine.assembly (layer 4) imports workers.worker (layer 5)" in upward_imports(graph)
