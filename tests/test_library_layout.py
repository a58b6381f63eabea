"""The library's layout keeps showing its architecture (issue 28; docs/architecture.md, "The rules").

Read from the source, every import included (the lazy ones inside functions too):
- no import circle anywhere in ``kvxfer``;
- each part imports only the parts below it in ``LAYERS`` (a part may always import itself);
- nothing in ``kvxfer`` but the command line (the front door) imports ``engine_integration``;
- no module imports another part's private names (``_name``, or a ``_module``).
"""

from __future__ import annotations

import ast

from import_graph import ROOT, cycle, imports, modules

#: part -> the parts it may import. A part is ``kvxfer.<first name>``, or ``engine_integration``.
LAYERS: dict[str, set[str]] = {
    "kvxfer.errors": set(),
    "kvxfer.plan": {"kvxfer.errors"},
    "kvxfer.security": {"kvxfer.errors"},
    "kvxfer.meta": {"kvxfer.errors", "kvxfer.plan", "kvxfer.security"},
    "kvxfer.backends": {"kvxfer.errors", "kvxfer.plan", "kvxfer.meta", "kvxfer.security"},
    "kvxfer.handoff": {"kvxfer.errors", "kvxfer.plan", "kvxfer.meta", "kvxfer.security", "kvxfer.backends"},
    "kvxfer.runtime": {"kvxfer.errors", "kvxfer.plan", "kvxfer.meta", "kvxfer.security", "kvxfer.backends",
                       "kvxfer.handoff"},
    "kvxfer.integrations": {"kvxfer.errors", "kvxfer.plan", "kvxfer.meta", "kvxfer.security", "kvxfer.backends",
                            "kvxfer.handoff", "kvxfer.runtime"},
    "kvxfer.megatron": {"kvxfer.errors", "kvxfer.backends"},
    "kvxfer.harness": {"kvxfer.errors", "kvxfer.plan", "kvxfer.meta", "kvxfer.security", "kvxfer.backends",
                       "kvxfer.handoff", "kvxfer.runtime"},
    "kvxfer.bench": {"kvxfer.errors", "kvxfer.plan", "kvxfer.meta", "kvxfer.security", "kvxfer.backends",
                     "kvxfer.handoff", "kvxfer.runtime", "kvxfer.harness", "kvxfer.integrations"},
    "kvxfer.cli": {"kvxfer.errors", "kvxfer.plan", "kvxfer.meta", "kvxfer.security", "kvxfer.backends",
                   "kvxfer.handoff", "kvxfer.runtime", "kvxfer.harness", "kvxfer.bench", "kvxfer.integrations",
                   "kvxfer.megatron", "engine_integration"},
    "kvxfer": {"kvxfer.errors", "kvxfer.backends"},  # the package's own __init__: the public names, lazily
    "kvxfer.__main__": {"kvxfer.cli"},
}


def part(module: str) -> str:
    names = module.split(".")
    if names[0] != "kvxfer":
        return names[0]
    return ".".join(names[:2]) if len(names) > 1 else "kvxfer"


def _graph() -> dict[str, set[str]]:
    return imports("kvxfer", among=("engine_integration",))


def test_no_import_circle_in_the_library():
    assert cycle(_graph()) == []


def test_every_part_imports_only_the_parts_below_it():
    graph = _graph()
    assert set(map(part, graph)) <= set(LAYERS), f"parts without a rule: {set(map(part, graph)) - set(LAYERS)}"
    wrong = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                   if part(d) != part(m) and part(d) not in LAYERS[part(m)])
    assert wrong == [], "imports against docs/architecture.md's rules:\n" + "\n".join(wrong)


def test_only_the_command_line_imports_the_engine_layer():
    graph = _graph()
    upward = sorted(m for m, deps in graph.items() if any(part(d) == "engine_integration" for d in deps))
    assert all(part(m) == "kvxfer.cli" for m in upward), upward


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
    assert "kvxfer.cli" not in LAYERS["kvxfer.bench"] and "engine_integration" not in LAYERS["kvxfer.bench"]
    assert (ROOT / "kvxfer" / "plan").is_dir()


def test_every_part_says_what_it_may_import():
    """Each package's ``__init__`` docstring says what it owns and what it may import (a reader starts there)."""
    silent = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "kvxfer").glob("*/__init__.py"))
              if "May import" not in (ast.get_docstring(ast.parse(p.read_text())) or "")]
    assert silent == [], silent
