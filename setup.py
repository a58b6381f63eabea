"""Build hook for kvxfer's compiled part: the cffi binding to UCX's UCP.

Everything else lives in pyproject.toml. The binding (``kvxfer/backends/ucx/_ucp_cffi``)
is compiled with setuptools' cffi integration (``cffi_modules``) against the
headers of the ``libucx-cu12`` wheel, which pyproject's ``[build-system] requires``
puts in the build environment.

If the binding cannot be built (no C compiler, no UCX headers) **the build fails**,
with the reason and the fix. It used to warn and go on, and pip hides a build's
warnings: users got a wheel that silently lacked the ``ucx`` backend. To build
without the binding on purpose (a machine with no compiler that only needs the
``nixl`` or ``local`` backends), set ``KVXFER_BUILD_WITHOUT_UCX=1``; ``kvxfer info``
then lists ``ucx`` as unavailable, with the fix.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

SKIP_ENV = "KVXFER_BUILD_WITHOUT_UCX"
FIX = (f"install a C compiler (e.g. `apt-get install gcc`) and build again, or set {SKIP_ENV}=1 to build "
       "kvxfer without the 'ucx' backend")


class BindingBuildError(RuntimeError):
    """The UCX binding could not be built; the message says why and how to fix it."""


class StrictBuildExt(build_ext):
    """Compiles the UCX binding; any failure stops the build with the reason and the fix."""

    def build_extension(self, ext) -> None:  # type: ignore[no-untyped-def]
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - re-raised with the fix attached
            raise BindingBuildError(f"kvxfer: building the UCX binding ({ext.name}) failed: {exc}. Fix: {FIX}") from exc


def _skip_requested() -> bool:
    return os.environ.get(SKIP_ENV, "").strip().lower() in ("1", "true", "yes")


def _missing_build_inputs() -> list[str]:
    """What the binding's build needs and this build environment lacks."""
    missing = []
    if importlib.util.find_spec("cffi") is None:
        missing.append("cffi")
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        missing.append("libucx-cu12 (the UCX headers)")
    else:
        prefix = Path(list(spec.submodule_search_locations)[0])
        if not (prefix / "include" / "ucp" / "api" / "ucp.h").is_file():
            missing.append(f"ucp/api/ucp.h under {prefix / 'include'}")
    return missing


def _extension_options() -> dict:
    if _skip_requested():
        return {}
    missing = _missing_build_inputs()
    if missing:
        raise BindingBuildError(
            f"kvxfer: cannot build the UCX binding: the build environment lacks {', '.join(missing)}. "
            f"Fix: build with pip's default build isolation (it installs them from pyproject.toml), or "
            f"`pip install cffi 'libucx-cu12>=1.21,<1.23'` before a --no-build-isolation build, or set {SKIP_ENV}=1")
    return {"cffi_modules": ["kvxfer/backends/ucx/binding_build.py:ffibuilder"]}


setup(cmdclass={"build_ext": StrictBuildExt}, **_extension_options())
