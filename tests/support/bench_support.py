"""Worker targets for the bench tests (they run in spawned workers, where a
pytest monkeypatch does not reach, so the fault is injected in the worker itself)."""

from __future__ import annotations

from typing import Any


def run_backend_with_lying_source(*args: Any, **kwargs: Any) -> Any:
    """``run_backend`` with a source whose digests never match what was read."""
    from kvxfer.bench import source
    from kvxfer.bench.sweep import run_backend

    source.SourceRole.digest = lambda self, ids: "0" * 64  # type: ignore[method-assign]
    return run_backend(*args, **kwargs)
