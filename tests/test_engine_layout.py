"""The engine layer's layout keeps showing its architecture (issue 22, item 1; docs/architecture.md).

Read from the source (every import, the lazy ones inside functions included): no import
circle in ``engine_integration``; the control-plane packages never import the engine, the
launcher or each other; the coordinator process and the etcd plane never load torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "engine_integration"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports() -> dict[str, set[str]]:
    """module -> the engine_integration modules it imports (a package's own ancestors left out)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
                targets = subs if len(subs) == len(node.names) else [node.module, *subs]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    deps.add(target)
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle (as a path), or [] if there is none."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
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


def test_no_import_circle_in_the_engine_layer():
    assert _cycle(_imports()) == []
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]   # the check can fail


def test_control_plane_packages_stand_apart():
    graph = _imports()
    plane_mods = {m: deps for m, deps in graph.items() if m.startswith("engine_integration.control_plane")}
    for module, deps in plane_mods.items():
        outside = {d for d in deps if not d.startswith("engine_integration.control_plane")
                   and d not in ("engine_integration.descriptor", "engine_integration.procs")}
        assert not outside, f"{module} imports {outside}: a plane sees the engine only through base.PlaneEngine"
        for this, other in (("zmq", "etcd"), ("etcd", "zmq")):
            if module.startswith(f"engine_integration.control_plane.{this}"):
                crossing = {d for d in deps if d.startswith(f"engine_integration.control_plane.{other}")}
                assert not crossing, f"{module} imports {crossing}: one package per plane"
    assert "engine_integration.etcd_engine" not in graph and "engine_integration.etcd_launch" not in graph


def test_the_coordinator_and_the_etcd_plane_never_load_torch():
    code = ("import sys; import engine_integration.control_plane.zmq.coordinator, "
            "engine_integration.control_plane.etcd.plane, engine_integration.control_plane.etcd.service; "
            "print('torch' in sys.modules, 'zmq' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "True"], out.stderr   # zmq: only for the coordinator module
    code = "import sys; import engine_integration.control_plane.etcd.plane; print('torch' in sys.modules, 'zmq' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr
