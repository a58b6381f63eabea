"""The package as a user gets it: a wheel built from a clean clone, installed in a clean venv.

What is tested is what is committed: the source is a ``git clone`` of this
checkout's HEAD (``KVXFER_PACKAGING_SOURCE`` may name another repository, e.g. a
scratch commit of a work tree). Uncommitted changes are not in the wheel.

* the clean-venv install (about 35 s here: torch comes from the machine's local
  wheel, the build dependencies from the package index or pip's cache) runs
  ``kvxfer info`` and ``kvxfer loopback --backend ucx`` from outside the checkout;
* building without a working compiler (``CC=/bin/false``) must fail loudly and
  name the fix, never ship a wheel without the UCX binding; with
  ``KVXFER_BUILD_WITHOUT_UCX=1`` it builds a pure-Python wheel on purpose.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ENV = "KVXFER_PACKAGING_SOURCE"
TORCH = "torch==2.13.0"  # as tools/bootstrap.sh: the CPU build served from local disk


def _run(cmd: list, *, env=None, cwd=None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A fresh clone of the committed tree: no build outputs, no ignored files, no uncommitted edits."""
    if not (ROOT / ".git").exists() and not os.environ.get(SOURCE_ENV):
        pytest.fail(f"not a git checkout: nothing committed to clone (set {SOURCE_ENV} to a repository)", pytrace=False)
    dest = tmp_path_factory.mktemp("clone") / "kvxfer"
    out = _run(["git", "clone", "--quiet", os.environ.get(SOURCE_ENV, str(ROOT)), dest])
    assert out.returncode == 0, out.stderr
    return dest


def _build_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(extra)
    return env


def _wheel(clone: Path, out_dir: Path, **env: str) -> subprocess.CompletedProcess:
    """``pip wheel`` with this interpreter's setuptools, cffi and libucx (no network, seconds)."""
    return _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", out_dir,
                 clone], env=_build_env(**env), cwd=out_dir.parent)


def test_building_without_a_compiler_fails_loudly_and_names_the_fix(clone, tmp_path):
    out_dir = tmp_path / "wheels"
    out_dir.mkdir()
    out = _wheel(clone, out_dir, CC="/bin/false")
    assert out.returncode != 0, "a wheel without the UCX binding was built silently"
    assert list(out_dir.iterdir()) == []
    log = out.stdout + out.stderr
    assert "building the UCX binding" in log and "KVXFER_BUILD_WITHOUT_UCX=1" in log and "C compiler" in log


def test_building_without_the_binding_on_purpose_gives_a_pure_python_wheel(clone, tmp_path):
    out_dir = tmp_path / "wheels"
    out_dir.mkdir()
    out = _wheel(clone, out_dir, CC="/bin/false", KVXFER_BUILD_WITHOUT_UCX="1")
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = out_dir.glob("*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")  # the name says: no compiled part
    assert not any(n.endswith(".so") for n in zipfile.ZipFile(wheel).namelist())


def test_the_wheel_carries_the_binding_the_types_marker_and_the_license(clone, tmp_path):
    out_dir = tmp_path / "wheels"
    out_dir.mkdir()
    out = _wheel(clone, out_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = out_dir.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("kvxfer/backends/ucx/_ucp_cffi") and n.endswith(".so") for n in names)
    assert "kvxfer/py.typed" in names and "kvxfer/__main__.py" in names
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    import kvxfer

    assert f"Version: {kvxfer.__version__}" in metadata
    requirements = [line.split(":", 1)[1].split(";")[0] for line in metadata.splitlines() if line.startswith("Requires-Dist")]
    assert requirements and not any("==" in r for r in requirements), requirements  # ranges, not exact pins


def test_a_clean_venv_installs_the_wheel_and_runs_info_and_a_ucx_loopback(clone, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py, pip = env_dir / "bin" / "python", [env_dir / "bin" / "python", "-m", "pip", "--disable-pip-version-check"]
    env = _build_env()
    # --no-compile: no .pyc for all of torch at install (15 s of CPU here); the few processes below compile what
    # they import instead (PYTHONDONTWRITEBYTECODE=1 here: each time), which costs less (this test: 55-63 s -> 34 s)
    out = _run([*pip, "install", "--quiet", "--no-compile", TORCH], env=env)
    assert out.returncode == 0, out.stderr
    wheels = tmp_path / "wheels"
    out = _run([*pip, "wheel", "--quiet", "--no-deps", "--wheel-dir", wheels, clone], env=env)  # build isolation
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = wheels.glob("*.whl")
    out = _run([*pip, "install", "--quiet", "--no-compile", wheel], env=env)
    assert out.returncode == 0, out.stderr

    outside = tmp_path / "elsewhere"  # not the checkout: nothing may be imported from the source tree
    outside.mkdir()
    kvxfer = env_dir / "bin" / "kvxfer"
    out = _run([py, "-c", "import kvxfer, sys; print(kvxfer.__file__)"], env=env, cwd=outside)
    assert out.returncode == 0 and str(env_dir) in out.stdout, out.stdout + out.stderr
    info = _run([kvxfer, "info"], env=env, cwd=outside, timeout=120)
    assert info.returncode == 0, info.stderr
    ucx_row = next(line for line in info.stdout.splitlines() if line.strip("│ ").startswith("ucx"))
    assert "yes" in ucx_row, info.stdout
    loop = _run([kvxfer, "loopback", "--backend", "ucx", "--layers", "4", "--heads", "2", "--head-dim", "32",
                 "--pool-blocks", "64", "--blocks", "24"], env=env, cwd=outside, timeout=300)
    assert loop.returncode == 0, loop.stdout + loop.stderr
    assert "exact" in loop.stdout and "OK" in loop.stdout
    version = _run([py, "-m", "kvxfer", "--version"], env=env, cwd=outside)
    assert version.returncode == 0 and version.stdout.startswith("kvxfer "), version.stderr
