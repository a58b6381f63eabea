"""The command's logging: the ``kvxfer`` and ``engine_integration`` logger hierarchies to stderr, at the
level ``-v``/``-q`` ask for.

The library only creates loggers, one per module, named by it (``logging.getLogger(__name__)``:
``kvxfer.backends.nixl.backend``, ``engine_integration.control_plane.etcd.plane``, ...);
configuring them is the application's job, and here the application is the CLI.
An engine that embeds kvxfer routes or silences the same loggers its own way.
Python warnings (``warnings.warn``) are routed through logging too, so ``-q``
silences them as well.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "kvxfer: %(levelname)s: %(name)s: %(message)s"
#: The hierarchies the command configures: the library's, the engine layer's, Python's warnings.
LOGGERS = ("kvxfer", "engine_integration", "py.warnings")


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time (test runners swap it)."""

    def __init__(self) -> None:
        super().__init__()

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201 - logging's own attribute
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


def level_for(verbose: int, quiet: bool) -> int:
    """WARNING by default; ``-v`` INFO, ``-vv`` DEBUG; ``-q`` ERROR."""
    if quiet:
        return logging.ERROR
    return {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)


def configure(verbose: int = 0, quiet: bool = False) -> None:
    """Send ``kvxfer.*`` and ``engine_integration.*`` (``kvxfer generate``'s engines), and Python warnings,
    to stderr at the chosen level; safe to call again."""
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.set_name("kvxfer-cli")
    level = level_for(verbose, quiet)
    logging.captureWarnings(True)
    for name in LOGGERS:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if h.get_name() == "kvxfer-cli"]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False
