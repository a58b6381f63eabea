"""A third-party backend plugin can break only itself (issue 39, item 5).

Real entry points: a distribution (``*.dist-info`` with ``entry_points.txt``) written into a temporary
folder put on ``PYTHONPATH`` of a fresh interpreter, as pip would install one. Its plugins misbehave the
ways a plugin can: ``availability()`` raises (with rich markup in its message), answers in the wrong
shape, its module exits at import, ``transport_probe()`` answers a list, a class without a name.

Before: ``available_backends()`` and ``default_backend_name()`` raised the plugin's exception, the
module's ``SystemExit`` ended the process that listed backends, and ``kvxfer info`` exited 1. Now each
is listed as unavailable with its reason, the listing and ``kvxfer info`` go on (exit 0), and
constructing such a backend raises ``BackendUnavailableError`` with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PLUGINS = '''
from kvxfer.backends.local.backend import LocalBackend


class Raises(LocalBackend):
    name = "raises"

    @classmethod
    def availability(cls):
        raise RuntimeError("driver [/bold]libfoo[/] probe crashed")


class Shapeless(LocalBackend):
    name = "shapeless"

    @classmethod
    def availability(cls):
        return True  # not (bool, str)


class OddProbe(LocalBackend):
    name = "odd-probe"

    @classmethod
    def transport_probe(cls):
        return ["not", "a", "dict"]


class Nameless(LocalBackend):
    name = None


class Fine(LocalBackend):
    name = "fine"
'''
ENTRIES = {
    "raises": "kvx_bad_plugins:Raises",
    "shapeless": "kvx_bad_plugins:Shapeless",
    "odd-probe": "kvx_bad_plugins:OddProbe",
    "nameless": "kvx_bad_plugins:Nameless",
    "exits": "kvx_exiting_plugin:Exits",
    "fine": "kvx_bad_plugins:Fine",
}


def _install(root: Path, entries: dict[str, str]) -> Path:
    """One installed distribution in ``root`` with a ``kvxfer.backends`` entry point per plugin."""
    (root / "kvx_bad_plugins.py").write_text(PLUGINS)
    (root / "kvx_exiting_plugin.py").write_text("raise SystemExit('libbar.so missing: exiting')\n")
    dist = root / "kvx_bad_plugins-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvx-bad-plugins\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[kvxfer.backends]\n" + "".join(f"{name} = {target}\n" for name, target in entries.items()))
    return root


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every broken plugin above, installed."""
    return _install(tmp_path_factory.mktemp("plugins"), ENTRIES)


@pytest.fixture(scope="module")
def raising_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Only the plugin whose ``availability()`` raises (the issue's row), installed."""
    return _install(tmp_path_factory.mktemp("raising"), {"raises": ENTRIES["raises"]})


def _run(plugin_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_path), str(ROOT)])}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)


LISTING = textwrap.dedent("""
    import json
    import torch
    from kvxfer.backends import (available_backends, construct_kv_transfer_backend_class, default_backend_name,
                                 transport_probes)
    from kvxfer.errors import BackendUnavailableError

    out = {"infos": {i.name: [i.available, i.reason] for i in available_backends()},
           "default": default_backend_name(), "probes": transport_probes(), "construct": {}}
    for name in ("raises", "shapeless"):
        try:
            construct_kv_transfer_backend_class(name)("x", torch.zeros(2, 4, 3), 4)
            out["construct"][name] = "constructed"
        except Exception as exc:
            out["construct"][name] = [type(exc).__name__, str(exc)]
    print("RESULT " + json.dumps(out))
""")


def _listing(path: Path) -> dict:
    done = _run(path, "-c", LISTING)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])


def test_a_plugin_whose_availability_raises_is_listed_unavailable_and_breaks_nothing(raising_path: Path) -> None:
    result = _listing(raising_path)
    infos = result["infos"]
    assert infos["raises"][0] is False and "RuntimeError: driver [/bold]libfoo[/] probe crashed" in infos["raises"][1]
    assert "kvx_bad_plugins:Raises" in infos["raises"][1] and infos["local"] == [True, ""]
    assert result["default"] in ("nixl", "ucx", "local")
    kind, message = result["construct"]["raises"]
    assert kind == "BackendUnavailableError" and "availability() raised RuntimeError" in message
    done = _run(raising_path, "-m", "kvxfer", "info")
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    assert "[/bold]libfoo[/]" in done.stdout.replace("\n", "").replace("│", "").replace(" ", "")


def test_every_way_a_plugin_can_break_lists_it_with_its_reason(plugin_path: Path) -> None:
    result = _listing(plugin_path)
    infos = result["infos"]
    assert infos["raises"][0] is False and "RuntimeError" in infos["raises"][1]
    assert infos["shapeless"][0] is False and "not (available: bool, reason: str)" in infos["shapeless"][1]
    assert infos["exits"][0] is False and "SystemExit: libbar.so missing" in infos["exits"][1]
    assert not infos["nameless"][0] and "no backend name" in infos["nameless"][1]
    assert infos["fine"] == [True, ""] and infos["odd-probe"][0] is True and infos["local"] == [True, ""]
    assert result["default"] in ("nixl", "ucx", "local")
    assert "not a dict" in result["probes"]["odd-probe"]["error"]
    for name in ("raises", "shapeless"):
        kind, message = result["construct"][name]
        assert kind == "BackendUnavailableError" and "availability()" in message, result["construct"]


def test_kvxfer_info_exits_0_and_shows_the_broken_plugins(plugin_path: Path) -> None:
    done = _run(plugin_path, "-m", "kvxfer", "info")
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    text = " ".join(done.stdout.split())  # the table wraps long reasons
    for shown in ("raises", "shapeless", "exits", "libbar.so missing", "odd-probe: error=transport_probe()"):
        assert shown in text, (shown, done.stdout[-4000:])
