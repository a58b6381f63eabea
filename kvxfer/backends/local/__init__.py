"""The ``local`` backend: same-process torch copies, the test oracle."""

from kvxfer.backends.local.backend import LocalBackend, LocalHandle

__all__ = ["LocalBackend", "LocalHandle"]
