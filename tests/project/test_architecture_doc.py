"""docs/architecture.md stays true of the tree (issue 52 item 6): it names every package (dotted, as a path, or
as ``name/`` where its parent is described), and every module it names exists.

Read from the doc's backticked spans. A dotted name (``kvxfer.handoff.guard``, ``kvxfer.handoff.guard.LeaseGuard``)
must resolve: its longest prefix that is a module or package of this repository, then at most one more name,
which that module defines at its top level (a class, a function, a constant, an import). A file name
(``ports.py``, ``kvxfer/runtime/ports.py``) must be a file of the project trees, by its path or the tail of
one. A name with a wildcard (``kvxfer.bench.vllm_*``) is not checked.
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
TREES = ("kvxfer", "engine_integration")
SPAN = re.compile(r"`([^`]+)`")
DOTTED = re.compile(r"^(?:kvxfer|engine_integration)(?:\.[A-Za-z_][A-Za-z0-9_]*)*$")
FILE = re.compile(r"^[A-Za-z0-9_./-]+\.py$")


def spans() -> list[str]:
    """The words of the doc's inline code spans (fenced blocks left out: their backticks pair with nothing)."""
    text = re.sub(r"^\s*```.*$", "", DOC.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return [word for span in SPAN.findall(text) for word in re.split(r"[\s,;()]+", span) if word]


def packages() -> list[str]:
    return sorted(".".join(init.parent.relative_to(ROOT).parts) for top in TREES
                  for init in (ROOT / top).rglob("__init__.py") if "__pycache__" not in init.parts)


def module_path(dotted: str) -> Path | None:
    base = ROOT.joinpath(*dotted.split("."))
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return None


@lru_cache(maxsize=None)
def top_level_names(path: Path) -> frozenset[str]:
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    if path.name == "__init__.py":  # a package's lazily exported names (``_EXPORTS``) count too
        text = path.read_text(encoding="utf-8")
        names.update(re.findall(r'^\s*"([A-Za-z_][A-Za-z0-9_]*)":', text, re.MULTILINE))
    return frozenset(names)


def unresolved(dotted: str) -> str | None:
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        path = module_path(".".join(parts[:n]))
        if path is None:
            continue
        rest = parts[n:]
        if not rest:
            return None
        if len(rest) == 1 and rest[0] in top_level_names(path):
            return None
        return f"{'.'.join(parts[:n])} has no {'.'.join(rest)!r}"
    return "no such module"


@lru_cache(maxsize=None)
def project_files() -> tuple[str, ...]:
    return tuple(p.relative_to(ROOT).as_posix() for top in (*TREES, "tests", "tools") for p in (ROOT / top).rglob("*.py")
                 if "__pycache__" not in p.parts)


def test_the_doc_names_every_package():
    text = DOC.read_text(encoding="utf-8")
    words = set(spans())
    missing = [p for p in packages() if p not in text and f"{p.replace('.', '/')}/" not in text
               and f"{p.rsplit('.', 1)[-1]}/" not in words]  # a sub-package named where its parent is described
    assert missing == [], f"docs/architecture.md does not name these packages (say what each owns): {missing}"


def test_every_module_the_doc_names_exists():
    wrong = []
    for word in spans():
        word = word.strip(".:'")
        if "*" in word or "<" in word:
            continue
        if DOTTED.match(word):
            why = unresolved(word)
            if why:
                wrong.append(f"{word}: {why}")
        elif FILE.match(word):
            if not (ROOT / word).is_file() and not any(f == word or f.endswith("/" + word) for f in project_files()):
                wrong.append(f"{word}: no such file")
    assert wrong == [], "docs/architecture.md names what is not there:\n" + "\n".join(sorted(set(wrong)))


def test_the_checks_can_fail():
    assert unresolved("kvxfer.handoff.no_such_module") is not None
    assert unresolved("kvxfer.handoff.guard") is None
    assert unresolved("kvxfer.runtime.ports.free_ports") is None
    assert unresolved("kvxfer.runtime.ports.nothing_here") is not None
    assert "kvxfer.meta" in packages()


# --- docs/environment.md lists every variable the code reads --------------------------------------------------

ENV_DOC = ROOT / "docs" / "environment.md"


def environment_reads(tree: ast.AST) -> set[str]:
    """The ``KVXFER_*`` names a module reads from the environment: the key of ``os.environ.get``,
    ``os.getenv``, ``environ.get``, ``os.environ[...]`` and ``... in os.environ``, given as text or as a
    module constant holding it."""
    constants = {t.id: n.value.value for n in getattr(tree, "body", []) if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                 for t in n.targets if isinstance(t, ast.Name)}

    def text(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return constants.get(node.id) if isinstance(node, ast.Name) else None

    def is_environ(node: ast.AST) -> bool:  # os.environ, environ, env, (os.environ if ... else environ)
        return "environ" in ast.unparse(node) or ast.unparse(node).split(".")[-1] == "env"

    keys = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = ast.unparse(node.func)
            if func.endswith("getenv") or (isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                                           and is_environ(node.func.value)):
                keys.append(text(node.args[0]))
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            keys.append(text(node.slice))
        elif isinstance(node, ast.Compare) and any(isinstance(op, ast.In) for op in node.ops) \
                and any(is_environ(c) for c in node.comparators):
            keys.append(text(node.left))
    return {k for k in keys if k and k.startswith("KVXFER_")}


def test_the_environment_doc_lists_every_variable_the_code_reads():
    read = {}
    for top in TREES:
        for path in (ROOT / top).rglob("*.py"):
            if "__pycache__" not in path.parts:
                for name in environment_reads(ast.parse(path.read_text(encoding="utf-8"))):
                    read.setdefault(name, path.relative_to(ROOT).as_posix())
    listed = ENV_DOC.read_text(encoding="utf-8")
    missing = sorted(f"{name} ({where})" for name, where in read.items() if f"`{name}`" not in listed)
    assert "KVXFER_SECRET_FILE" in read and "KVXFER_SGLANG_PYTHON" in read  # the reader finds real reads
    assert missing == [], "docs/environment.md does not list these variables the code reads: " + ", ".join(missing)
