"""kvx_core's subpackages import each other without cycles, and `formats` (the math) imports nothing from `ops`
(the kernels and the dispatcher that chooses among them). Every `import` / `from ... import` counts, module-level
or inside a function: a lazy import is still a dependency."""
from __future__ import annotations

import ast
from itertools import pairwise
from pathlib import Path

import kvx_core

ROOT = Path(kvx_core.__file__).parent


def _unit(module: str) -> str | None:
    """The layer a kvx_core module belongs to: its subpackage (`ops`, `formats`, ...), None for a top-level module."""
    parts = module.split(".")
    if parts[0] != "kvx_core" or len(parts) < 2 or not (ROOT / parts[1]).is_dir():
        return None
    return parts[1]


def _imports(path: Path) -> set[str]:
    """Absolute names of the kvx_core modules (or the packages a name is taken from) `path` imports."""
    package = ".".join(("kvx_core", *path.relative_to(ROOT).parent.parts))  # what `from .` names
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[:len(parts) - node.level + 1] if node.level else []
            target = ".".join([*base, node.module] if node.module else base)
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)  # `from . import ops` names a subpackage
    return {name for name in found if name.startswith("kvx_core.")}


def _edges() -> dict[tuple[str, str], list[str]]:
    """(from_layer, to_layer) -> the 'file -> module' imports that make the edge."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        src = _unit(".".join(("kvx_core", *path.relative_to(ROOT).parts)))
        for name in sorted(_imports(path)):
            dst = _unit(name)
            if src and dst and src != dst:
                edges.setdefault((src, dst), []).append(f"{path.relative_to(ROOT)} -> {name}")
    return edges


def _cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """Every elementary cycle's layers, found by DFS from each layer (small graph)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    cycles = []

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                cycles.append([*path, start])
            elif nxt not in path and nxt > start:  # report each cycle once, from its smallest layer
                walk(start, nxt, [*path, nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return cycles


def test_the_import_scanner_sees_layers():
    """Guard against a scanner that finds nothing: ops does import formats."""
    assert ("ops", "formats") in _edges()


def test_formats_imports_nothing_from_ops():
    edges = _edges()
    assert ("formats", "ops") not in edges, "formats -> ops:\n" + "\n".join(edges[("formats", "ops")])


def test_no_cycles_between_subpackages():
    edges = _edges()
    report = []
    for cycle in _cycles(edges):
        report.append(" -> ".join(cycle))
        for a, b in pairwise(cycle):
            report.extend(f"    {line}" for line in edges[(a, b)])
    assert not report, "import cycles between kvx_core subpackages:\n" + "\n".join(report)


def _module_edges(package: str) -> dict[str, set[str]]:
    """Module -> the sibling modules of `package` it imports."""
    graph: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).glob("*.py")):
        name = f"kvx_core.{package}.{path.stem}"
        graph[name] = {m for m in _imports(path)
                       if m.startswith(f"kvx_core.{package}.") and m != name and m.count(".") == 2}
    return graph


def test_transfer_handoff_and_host_do_not_import_each_other_both_ways():
    graph = _module_edges("transfer")
    both = "kvx_core.transfer.host" in graph["kvx_core.transfer.handoff"] and \
        "kvx_core.transfer.handoff" in graph["kvx_core.transfer.host"]
    assert not both, "transfer/handoff.py <-> transfer/host.py"
