"""Build hook for the optional compiled part of kvxfer: the cffi binding to UCX's UCP.

Everything else lives in pyproject.toml. The binding (``kvxfer/backends/ucx/_ucp_cffi``)
is built with setuptools' cffi integration (``cffi_modules``) against the headers
of the ``libucx-cu12`` wheel, which pyproject's ``[build-system] requires`` puts in
the build environment. If it cannot be built (no compiler, no headers), kvxfer
still installs: the ``ucx`` backend then reports itself unavailable, with the fix.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """A failed compile of the UCX binding is a warning, not a failed install."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any build failure must leave the pure-Python package usable
            self._warn(exc)

    def build_extension(self, ext) -> None:  # type: ignore[no-untyped-def]
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            self._warn(exc)

    @staticmethod
    def _warn(exc: Exception) -> None:
        print(f"WARNING: kvxfer's UCX binding was not built ({exc}); the 'ucx' backend will be unavailable",
              file=sys.stderr)


def _ucx_headers_present() -> bool:
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        return False
    prefix = list(spec.submodule_search_locations)[0]
    return os.path.isfile(os.path.join(prefix, "include", "ucp", "api", "ucp.h")) and importlib.util.find_spec("cffi") is not None


extra = {}
if _ucx_headers_present():
    extra["cffi_modules"] = ["kvxfer/backends/ucx/binding_build.py:ffibuilder"]
else:
    print("WARNING: libucx-cu12 or cffi missing at build time; building kvxfer without the UCX binding", file=sys.stderr)

setup(cmdclass={"build_ext": OptionalBuildExt}, **extra)
