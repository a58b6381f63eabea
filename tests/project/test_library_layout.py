"""The library's layout keeps showing its architecture (docs/architecture.md).

``LAYERS`` below is the one statement of which part of ``kvxfer`` and of ``engine_integration`` may import
which: docs/architecture.md shows it (a section generated from it, which ``test_the_doc_shows_the_layers``
compares, and ``python tests/project/test_library_layout.py`` rewrites), and the packages' docstrings point
here. Read from the source, every import included (the lazy ones inside functions too):
- no import circle anywhere in ``kvxfer`` or ``engine_integration``;
- each part imports only the parts ``LAYERS`` gives it (a part may always import itself);
- nothing in ``kvxfer`` but the command line (the front door) imports ``engine_integration``;
- no module imports another part's private names (``_name``, or a ``_module``);
- every module logs under its own name;
- no backend name is compared outside ``kvxfer/backends/`` (callers ask the backend class).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # run as a script, too
from import_graph import ROOT, cycle, imports, modules

_BASE = {"kvxfer.errors", "kvxfer.defaults"}
_WIRE = _BASE | {"kvxfer.plan", "kvxfer.meta", "kvxfer.security"}
_LIBRARY = _WIRE | {"kvxfer.backends", "kvxfer.handoff", "kvxfer.runtime"}
_ENGINE = "engine_integration"
_PLANE = f"{_ENGINE}.control_plane"
#: What both plane packages stand on: the plane interface, the policy, the limits, what a prefill publishes,
#: and the process helpers (a plane starts its own services).
_PLANE_FLOOR = {f"{_PLANE}.base", f"{_PLANE}.policy", f"{_PLANE}.limits", f"{_ENGINE}.descriptor", f"{_ENGINE}.procs"}

#: part -> the parts it may import. A part is ``kvxfer.<first name>``; in ``engine_integration``,
#: ``engine_integration.<first name>``, and in its ``control_plane`` package each module or plane package
#: (``engine_integration.control_plane.etcd``); a package's own ``__init__`` is the package's name.
LAYERS: dict[str, set[str]] = {
    "kvxfer.errors": set(),
    "kvxfer.defaults": {"kvxfer.errors"},
    "kvxfer.plan": {"kvxfer.errors"},
    "kvxfer.security": {"kvxfer.errors"},
    "kvxfer.meta": {"kvxfer.errors", "kvxfer.plan", "kvxfer.security"},
    "kvxfer.backends": {"kvxfer.errors", "kvxfer.defaults", "kvxfer.plan", "kvxfer.meta", "kvxfer.security"},
    "kvxfer.handoff": _WIRE | {"kvxfer.backends"},
    "kvxfer.runtime": _WIRE | {"kvxfer.backends"},
    "kvxfer.integrations": _LIBRARY,
    "kvxfer.megatron": {"kvxfer.errors", "kvxfer.backends"},
    "kvxfer.harness": _LIBRARY,
    "kvxfer.drive": _LIBRARY | {"kvxfer.integrations"},  # real vLLM and SGLang processes: benches and tests use it
    "kvxfer.bench": _LIBRARY | {"kvxfer.harness", "kvxfer.integrations", "kvxfer.drive"},
    "kvxfer.cli": _LIBRARY | {"kvxfer.harness", "kvxfer.bench", "kvxfer.drive", "kvxfer.integrations", "kvxfer.megatron",
                              _PLANE, f"{_PLANE}.etcd", f"{_ENGINE}.launch", f"{_ENGINE}.prompts",
                              f"{_ENGINE}.bench"},
    "kvxfer": {"kvxfer.errors", "kvxfer.backends"},  # the package's own __init__: the public names, lazily
    "kvxfer.__main__": {"kvxfer.cli"},
    # engine_integration: beside the library, using its public parts, never its tooling (cli, harness, bench)
    _ENGINE: set(),  # its __init__: the public names, by module path, lazily
    f"{_ENGINE}.descriptor": _BASE,
    f"{_ENGINE}.procs": _BASE,
    f"{_ENGINE}.prompts": _BASE,
    f"{_ENGINE}.reference": _BASE,
    f"{_ENGINE}.adapter": _BASE | {f"{_ENGINE}.descriptor"},
    f"{_ENGINE}.reference_adapter": {f"{_ENGINE}.adapter"},
    f"{_ENGINE}.source": _BASE | {f"{_ENGINE}.adapter", f"{_ENGINE}.descriptor", "kvxfer.handoff"},
    f"{_ENGINE}.sink": _BASE | {f"{_ENGINE}.adapter", f"{_ENGINE}.descriptor", "kvxfer.handoff"},
    f"{_PLANE}.base": _BASE,
    f"{_PLANE}.policy": _BASE | {"kvxfer.meta"},  # the fields peers must agree on (meta.agreement)
    f"{_PLANE}.limits": _BASE,
    f"{_PLANE}.zmq": _WIRE | _PLANE_FLOOR | {"kvxfer.runtime"},
    f"{_PLANE}.etcd": _WIRE | _PLANE_FLOOR | {"kvxfer.runtime"},
    _PLANE: _BASE | {f"{_PLANE}.base", f"{_PLANE}.zmq", f"{_PLANE}.etcd", "kvxfer.backends"},  # opens a plane by URL
    f"{_ENGINE}.handoff_engine": _BASE | {f"{_ENGINE}.adapter", f"{_ENGINE}.descriptor", f"{_ENGINE}.reference",
                                          f"{_ENGINE}.reference_adapter", f"{_ENGINE}.sink", f"{_ENGINE}.source",
                                          f"{_PLANE}.policy", "kvxfer.backends", "kvxfer.handoff"},
    f"{_ENGINE}.disagg_engine": _BASE | {f"{_ENGINE}.handoff_engine", f"{_ENGINE}.sink", f"{_ENGINE}.descriptor",
                                         f"{_ENGINE}.reference", _PLANE, f"{_PLANE}.base",
                                         f"{_PLANE}.zmq",  # only to spawn a coordinator
                                         "kvxfer.handoff"},
    f"{_ENGINE}.engine": {f"{_ENGINE}.handoff_engine", f"{_ENGINE}.disagg_engine", f"{_ENGINE}.reference_adapter",
                          f"{_PLANE}.base"},
    f"{_ENGINE}.worker": _BASE | {f"{_ENGINE}.disagg_engine", _PLANE, f"{_ENGINE}.procs", f"{_ENGINE}.reference",
                                  "kvxfer.backends", "kvxfer.security"},
    f"{_ENGINE}.launch": _BASE | {f"{_ENGINE}.worker", _PLANE, f"{_ENGINE}.procs", f"{_ENGINE}.prompts",
                                  f"{_ENGINE}.reference", "kvxfer.backends", "kvxfer.security"},
    f"{_ENGINE}.bench": _BASE | {f"{_ENGINE}.launch", f"{_PLANE}.zmq", f"{_PLANE}.etcd", f"{_ENGINE}.descriptor",
                                 f"{_ENGINE}.procs", f"{_ENGINE}.reference", "kvxfer.backends", "kvxfer.meta"},
}

DOC = ROOT / "docs" / "architecture.md"
#: The generated section of ``DOC``: everything between these two lines.
DOC_BEGIN = "<!-- layers: generated from LAYERS in tests/project/test_library_layout.py; run that file to rewrite -->"
DOC_END = "<!-- /layers -->"


def part(module: str) -> str:
    names = module.split(".")
    if names[0] == _ENGINE and len(names) > 2 and names[1] == "control_plane":
        return ".".join(names[:3])
    return ".".join(names[:2])


def _graph() -> dict[str, set[str]]:
    return imports("kvxfer", "engine_integration")


def test_no_import_circle_in_the_library():
    assert cycle(_graph()) == []


def test_no_import_circle_between_the_parts():
    parts: dict[str, set[str]] = {}
    for module, deps in _graph().items():
        parts.setdefault(part(module), set()).update(part(d) for d in deps if part(d) != part(module))
    assert cycle(parts) == []


def test_every_part_imports_only_the_parts_below_it():
    graph = _graph()
    assert set(map(part, graph)) <= set(LAYERS), f"parts without a rule: {set(map(part, graph)) - set(LAYERS)}"
    wrong = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                   if part(d) != part(m) and part(d) not in LAYERS[part(m)])
    assert wrong == [], "imports against docs/architecture.md's rules:\n" + "\n".join(wrong)


def test_only_the_command_line_imports_the_engine_layer():
    graph = _graph()
    upward = sorted(m for m, deps in graph.items()
                    if m.startswith("kvxfer") and any(d.startswith(_ENGINE) for d in deps))
    assert upward and all(part(m) == "kvxfer.cli" for m in upward), upward


def test_no_module_imports_another_parts_private_names():
    reaching = []
    for name, path in {**modules("kvxfer"), **modules("engine_integration")}.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0):
                continue
            if node.module.split(".")[0] not in ("kvxfer", "engine_integration") or part(node.module) == part(name):
                continue
            private_module = any(n.startswith("_") and not n.startswith("__") for n in node.module.split("."))
            for alias in node.names:
                if private_module or alias.name.startswith("_"):
                    reaching.append(f"{name}: from {node.module} import {alias.name}")
    assert reaching == [], reaching


def test_the_rules_can_fail():
    assert cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert "kvxfer.cli" not in LAYERS["kvxfer.bench"] and not any(p.startswith(_ENGINE) for p in LAYERS["kvxfer.bench"])
    assert f"{_PLANE}.etcd" not in LAYERS[f"{_PLANE}.zmq"] and f"{_PLANE}.zmq" not in LAYERS[f"{_PLANE}.etcd"]
    assert part("engine_integration.control_plane.etcd.store") == f"{_PLANE}.etcd"
    assert part("engine_integration.reference.model") == f"{_ENGINE}.reference"
    assert (ROOT / "kvxfer" / "plan").is_dir()


def test_every_part_points_to_the_one_statement_of_the_layers():
    """Each package's ``__init__`` docstring (where a reader starts) points to ``LAYERS`` rather than restating
    it, and no module's docstring restates its imports ("May import"): a second copy of the rules is one
    that drifts (one named a ``poll`` module that did not exist)."""
    inits = sorted((ROOT / "kvxfer").glob("*/__init__.py")) + [ROOT / _ENGINE / "__init__.py"]
    wrong = [str(p.relative_to(ROOT)) for p in inits
             if "tests/project/test_library_layout.py" not in (ast.get_docstring(ast.parse(p.read_text())) or "")]
    assert wrong == [], f"say 'Its imports: LAYERS in tests/project/test_library_layout.py': {wrong}"
    restating = [name for name, path in sorted({**modules("kvxfer"), **modules(_ENGINE)}.items())
                 if "May import" in (ast.get_docstring(ast.parse(path.read_text())) or "")]
    assert restating == [], f"these docstrings restate their imports ('May import'); LAYERS says it: {restating}"


def test_every_part_with_a_rule_exists():
    present = set(map(part, _graph()))
    assert set(LAYERS) <= present, f"rules for parts that are gone: {set(LAYERS) - present}"


# --- the doc shows LAYERS ---------------------------------------------------------------------------------

def heights() -> dict[str, int]:
    """Each part's height: 0 for one that may import no other part, else one above the highest it may import."""
    assert cycle(LAYERS) == [], "LAYERS itself has a circle"
    memo: dict[str, int] = {}

    def height(p: str) -> int:
        if p not in memo:
            memo[p] = 1 + max((height(d) for d in LAYERS[p] if d in LAYERS), default=-1)
        return memo[p]

    return {p: height(p) for p in LAYERS}


def layers_section() -> str:
    """docs/architecture.md's section on the layers, from ``LAYERS``: the parts by height (the picture: a part
    may import only parts on rows below its own), then what each may import, nearest first."""
    height = heights()
    top = max(height.values())
    label = {"kvxfer": "kvxfer (its __init__)"}
    lines = [DOC_BEGIN, "", "```"]
    for h in range(top, -1, -1):
        lines.append("   ".join(label.get(p, p) for p in sorted(p for p in LAYERS if height[p] == h)))
    lines += ["```", "", "| part | may import (besides itself) |", "|---|---|"]
    for p in sorted(LAYERS, key=lambda p: (-height[p], p)):
        allowed = sorted(LAYERS[p], key=lambda d: (-height.get(d, top + 1), d))
        lines.append(f"| `{label.get(p, p)}` | {', '.join(f'`{d}`' for d in allowed) or 'nothing'} |")
    return "\n".join([*lines, "", DOC_END])


def _doc_section(text: str) -> str:
    begin, end = text.find(DOC_BEGIN), text.find(DOC_END)
    assert 0 <= begin < end, f"{DOC.name} has no section between {DOC_BEGIN!r} and {DOC_END!r}"
    return text[begin:end + len(DOC_END)]


def test_the_doc_shows_the_layers():
    shown = _doc_section(DOC.read_text())
    assert shown == layers_section(), (f"{DOC.relative_to(ROOT)} and LAYERS disagree: change LAYERS, then run "
                                       "'python tests/project/test_library_layout.py' to rewrite the doc's section")
    assert "kvxfer.integrations" in shown and "`engine_integration.control_plane.etcd`" in shown


# --- loggers ----------------------------------------------------------------------------------------------

def test_every_module_logs_under_its_own_name():
    """``logging.getLogger(__name__)``: a name typed by hand drifts (``kvxfer.engine.etcd`` beside
    ``kvxfer.engine.control_plane.etcd`` for one package). A module run with ``python -m`` spells out its
    own name (there ``__name__`` is ``"__main__"``)."""
    typed = []
    for name, path in sorted({**modules("kvxfer"), **modules("engine_integration")}.items()):
        for node in ast.parse(path.read_text()).body:
            call = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            if not (isinstance(call, ast.Call) and ast.unparse(call.func) == "logging.getLogger"):
                continue
            arg = call.args[0] if call.args else None
            if not ((isinstance(arg, ast.Name) and arg.id == "__name__")
                    or (isinstance(arg, ast.Constant) and arg.value == name)):
                typed.append(f"{name}: {ast.unparse(call)}")
    assert typed == [], typed


# --- capabilities live on the backend class, not in lists of names (issue 41, item 2) ----------------------

def backend_name_uses(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """``(line, what)`` for each place ``tree`` decides by a backend's name: a comparison with one (``==``,
    ``in`` a tuple of them), a ``case "ucx":``, a dict whose keys are all backend names (a table per
    backend), and a module-level collection of only backend names."""
    def is_name(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names

    def only_names(node: ast.AST) -> bool:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("frozenset", "set",
                                                                                               "tuple") and node.args:
            node = node.args[0]
        if isinstance(node, ast.Dict):
            return bool(node.keys) and all(k is not None and is_name(k) for k in node.keys)
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and bool(node.elts) and all(map(is_name, node.elts))

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(is_name(s) or only_names(s) for s in [node.left, *node.comparators]):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.MatchValue) and is_name(node.value):
            found.append((node.lineno, f"case {ast.unparse(node.value)}"))
        elif isinstance(node, ast.Dict) and only_names(node):
            found.append((node.lineno, "{" + ", ".join(f"{ast.unparse(k)}: ..." for k in node.keys if k is not None) + "}"))
    for node in getattr(tree, "body", []):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if targets and node.value is not None and only_names(node.value) and not isinstance(node.value, ast.Dict):
            found.append((node.lineno, ",".join(ast.unparse(t) for t in targets)))
    return sorted(found)


def test_no_backend_name_is_compared_outside_the_backends():
    """A new backend states what it can do on its class (``is_push``, ``reads_other_processes``, ...) and its
    callers ask the class the registry returns: a ``backend == "local"``, a ``{"nixl": ..., "ucx": ...}``
    table or a set of names anywhere else would need editing for it. A default (``backend: str = "local"``)
    is configuration, not a decision, and is not looked at."""
    import kvxfer.backends as registry

    names = set(registry.BUILTIN_BACKENDS)
    found = []
    for module, path in sorted({**modules("kvxfer"), **modules("engine_integration")}.items()):
        rel = str(path.relative_to(ROOT))
        if module.startswith("kvxfer.backends"):
            continue
        for line, what in backend_name_uses(ast.parse(path.read_text()), names):
            found.append(f"{rel}:{line}: {what}")
    assert found == [], "ask the backend class instead:\n" + "\n".join(found)


def test_the_backend_name_check_can_fail():
    names = {"local", "nixl", "ucx", "nccl"}
    code = """
if b == "local": pass
X = frozenset({"nixl", "ucx"})
if kind in ("ucx", "nixl"): pass
PER_BACKEND = {"nixl": 1, "ucx": 2}
match b:
    case "nccl": pass
def f(backend: str = "local", connector={"nixl": 1, "kvxfer": 2}): return backend
"""
    assert backend_name_uses(ast.parse(code), names) == [
        (2, "b == 'local'"), (3, "X"), (4, "kind in ('ucx', 'nixl')"), (5, "{'nixl': ..., 'ucx': ...}"), (7, "case 'nccl'")]


if __name__ == "__main__":  # rewrite docs/architecture.md's section from LAYERS
    text = DOC.read_text()
    DOC.write_text(text.replace(_doc_section(text), layers_section()))
    print(f"rewrote the layers in {DOC.relative_to(ROOT)}", file=sys.stderr)
