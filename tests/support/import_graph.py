"""The import graph of the repository's packages, read from the source (every import, the lazy ones
inside functions included), for the layout tests (``test_engine_layout``, ``test_library_layout``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def modules(*packages: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``packages`` (a package by its own name)."""
    out = {}
    for package in packages:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports(*packages: str, among: tuple[str, ...] = ()) -> dict[str, set[str]]:
    """module of ``packages`` -> the modules of ``packages + among`` it imports (its own ancestors left out)."""
    own = modules(*packages)
    known = {**modules(*among), **own}
    graph: dict[str, set[str]] = {}
    for name, path in own.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known]
                targets = subs if len(subs) == len(node.names) else [node.module, *subs]
            for target in targets:
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    deps.add(target)
        graph[name] = deps
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle (as a path), or [] if there is none."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in graph:
                continue
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []
