"""Every package with more than two modules has a map (issue 52, item 6).

A *package* is a folder with an ``__init__.py`` under ``kvxfer/`` or ``engine_integration/`` (the two
roots included). Its *modules* are its ``.py`` files other than ``__init__.py`` plus its direct
sub-packages (each sub-package counts as one module). A package with more than two modules must have a
``README.md`` beside its ``__init__.py``: key files, a reading order, common change areas, the tests to
run (the shape of ``kvxfer/backends/README.md``, after vLLM's ``kv_connector/v1/nixl/`` README).

What a README names is read from its backticked spans (`` `served.py` ``, `` `ucx/peer.py` ``,
`` `kvxfer/backends/ucx/served.py` ``, `` `zmq/` ``); a span with several words is split on spaces and
punctuation, and every word that ends in ``.py`` (a file) or ``/`` (a folder) is a name. The tests:

- ``test_every_big_package_has_a_map``: each package with more than two modules has a ``README.md``.
- ``test_every_module_is_on_the_map``: each module of a package (``name.py``, or a sub-package ``name/``)
  is named in that package's README: ``name.py`` (or a path ending ``/name.py``) for a file, and for a
  sub-package ``name/`` or a path through it (``name/x.py``). A new module goes on the map when it lands.
- ``test_every_named_file_exists``: each ``.py`` a README names exists. A path that starts with a folder
  of the repository root (``kvxfer/...``, ``tests/...``) must exist there (or under the README's package).
  Any other name must be a file at the root (``setup.py``), a file of the README's package (``served.py``,
  ``ucx/peer.py`` from ``kvxfer/backends``), or the tail of a file's path in the project trees (``kvxfer``,
  ``engine_integration``, ``tests``, ``tools``), since a map may name a neighbour's file by its name
  (``sender.py`` beside "the vLLM connector's"); so a bare name is caught once no file of that name is
  left anywhere. Not checked: a name with a placeholder in it (``<name>``, ``*``, or ``foo`` as a part, the
  READMEs' "add a backend ``foo``"), and a path into another project (one whose folder exists nowhere in
  this one, such as ``sglang/srt/disaggregation/nixl/conn.py``).
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: the trees whose packages need maps
PACKAGE_ROOTS = ("kvxfer", "engine_integration")
#: where a README's names of other files are looked up
PROJECT_TREES = ("kvxfer", "engine_integration", "tests", "tools")
#: more modules than this, and a package needs a README
MAX_MODULES_WITHOUT_MAP = 2

SPAN = re.compile(r"`([^`]+)`")  # an inline code span may run over a line break
FENCE = re.compile(r"^\s*```.*$", re.MULTILINE)
WORD = re.compile(r"[^\s,;:()\[\]'\"=]+")
PLACEHOLDER = re.compile(r"[<>*{}]|(^|[/_])foo([/_.]|$)")


def packages() -> list[Path]:
    found = []
    for top in PACKAGE_ROOTS:
        for init in sorted((ROOT / top).rglob("__init__.py")):
            if "__pycache__" not in init.parts:
                found.append(init.parent)
    return found


def modules(package: Path) -> list[str]:
    """``x.py`` for each module file, ``x/`` for each sub-package, sorted."""
    files = sorted(p.name for p in package.glob("*.py") if p.name != "__init__.py")
    subs = sorted(p.parent.name + "/" for p in package.glob("*/__init__.py"))
    return files + subs


def named(readme: Path) -> set[str]:
    """The file (``.py``) and folder (``/``) names in ``readme``'s backticked spans."""
    names = set()
    for span in SPAN.findall(FENCE.sub("", readme.read_text(encoding="utf-8"))):
        for word in WORD.findall(span):
            if word.startswith("./"):
                word = word[2:]
            if word.endswith(".py") or (word.endswith("/") and len(word) > 1):
                names.add(word)
    return names


@lru_cache(maxsize=None)
def project_paths() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(every ``.py`` file, every folder) in the project trees, as paths from the root."""
    files, folders = [], set()
    for tree in PROJECT_TREES:
        for path in (ROOT / tree).rglob("*"):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(ROOT).as_posix()
            if path.is_dir():
                folders.add(rel)
            elif path.suffix == ".py":
                files.append(rel)
    folders.update(PROJECT_TREES)
    return tuple(files), tuple(sorted(folders))


def ends_with(path: str, tail: str) -> bool:
    return path == tail or path.endswith("/" + tail)


def names_module(name: str, package: Path, module: str) -> bool:
    """Whether the README word ``name`` names ``module`` (``x.py`` or ``x/``) of ``package``."""
    target = (package / module.rstrip("/")).relative_to(ROOT).as_posix()
    if module.endswith("/"):
        parts = name.rstrip("/").split("/") if name.endswith("/") else name.split("/")[:-1]
        return any(ends_with(target, "/".join(parts[:n])) for n in range(1, len(parts) + 1))
    return ends_with(target, name)


def missing_file(name: str, package: Path) -> bool:
    """Whether the ``.py`` that README word ``name`` names exists nowhere it may be (see the docstring)."""
    if PLACEHOLDER.search(name):
        return False
    first = name.split("/", 1)[0]
    if "/" in name and first in {p.name for p in ROOT.iterdir()}:
        return not (ROOT / name).is_file() and not (package / name).is_file()
    if (ROOT / name).is_file() or (package / name).is_file():
        return False  # a file at the root (``setup.py``), or of this package (``ucx/peer.py``)
    if any(ends_with(f, name) for f in project_paths()[0]):
        return False  # a neighbour's file, by its name or the tail of its path
    if "/" in name:
        folder = name.rsplit("/", 1)[0]
        if not any(ends_with(d, folder) for d in project_paths()[1]):
            return False  # another project's file
    return True


def big_packages() -> list[Path]:
    return [p for p in packages() if len(modules(p)) > MAX_MODULES_WITHOUT_MAP]


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_the_rule_sees_the_packages() -> None:
    found = {rel(p) for p in packages()}
    assert {"kvxfer", "kvxfer/backends/ucx", "engine_integration/control_plane/etcd"} <= found
    assert "kvxfer/bench" in {rel(p) for p in big_packages()}


def test_every_big_package_has_a_map() -> None:
    lacking = [f"{rel(p)} ({len(modules(p))} modules)" for p in big_packages() if not (p / "README.md").is_file()]
    assert not lacking, (
        "these packages have more than two modules and no README.md (key files, reading order, common change "
        "areas, tests to run; see kvxfer/backends/README.md): " + ", ".join(lacking))


@pytest.mark.parametrize("package", [p for p in big_packages() if (p / "README.md").is_file()], ids=rel)
def test_every_module_is_on_the_map(package: Path) -> None:
    """(A big package without a map is test_every_big_package_has_a_map's failure.)"""
    readme = package / "README.md"
    words = named(readme)
    absent = [m for m in modules(package) if not any(names_module(w, package, m) for w in words)]
    assert not absent, (
        f"{rel(readme)} does not name these modules of its package (add each to the map, with its one job, "
        f"in backticks): {', '.join(absent)}")


@pytest.mark.parametrize("package", [p for p in packages() if (p / "README.md").is_file()], ids=rel)
def test_every_named_file_exists(package: Path) -> None:
    readme = package / "README.md"
    text = FENCE.sub("", readme.read_text(encoding="utf-8"))
    assert text.count("`") % 2 == 0, f"{rel(readme)} has an unclosed backtick: the names after it would be misread"
    gone = sorted(w for w in named(readme) if w.endswith(".py") and missing_file(w, package))
    assert not gone, f"{rel(readme)} names files that do not exist: {', '.join(gone)}"


def test_the_checks_catch_what_they_should(tmp_path: Path) -> None:
    """The parsing on a made-up README: a stale name is caught, a module left off is seen."""
    readme = tmp_path / "README.md"
    readme.write_text("1. `served.py` (reads), `ucx/peer.py`, `kvxfer/backends/ucx/gone_module.py`,\n"
                      "   `tests/backends/test_<name>_backend.py`, `python -m kvxfer.bench` and `zmq/`; a span\n"
                      "   over a line break: `notices.py (a,\n   b)` then `peer_after.py`.\n```\ncode\n```\n")
    words = named(readme)
    assert {"served.py", "ucx/peer.py", "kvxfer/backends/ucx/gone_module.py", "zmq/", "notices.py",
            "peer_after.py"} <= words
    assert not any(w.startswith(("(", "b)")) for w in words)
    ucx = ROOT / "kvxfer" / "backends" / "ucx"
    assert not missing_file("served.py", ucx)
    assert missing_file("kvxfer/backends/ucx/gone_module.py", ucx)
    assert missing_file("gone_module_never_written.py", ucx)
    assert not missing_file("tests/backends/test_<name>_backend.py", ucx)
    assert not missing_file("kvxfer/backends/foo/backend.py", ucx)  # the READMEs' example name
    assert not missing_file("sglang/srt/disaggregation/nixl/conn.py", ucx)  # another project's file
    assert missing_file("ucx/gone_module.py", ucx.parent)
    assert names_module("served.py", ucx, "served.py")
    assert not names_module("served_binding.py", ucx, "served.py")
    backends = ROOT / "kvxfer" / "backends"
    assert names_module("ucx/", backends, "ucx/") and names_module("ucx/peer.py", backends, "ucx/")
    assert not names_module("ucx/", backends, "nixl/")
