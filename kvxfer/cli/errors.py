"""How the ``kvxfer`` command fails: one line on stderr, an exit status a script can act on.

* a usage error (a bad option, a file that is not there, a backend that cannot run
  here) exits 2, before anything runs;
* a run that started and failed (bytes did not verify, a peer died) exits 1;
* ``--debug`` adds the traceback (and a child process's own traceback) above the line.

The line is always ``kvxfer: error: <what> (<how to fix>)``.
"""

from __future__ import annotations

import sys
import traceback
from typing import Optional

USAGE = 2
FAILED = 1
INTERRUPTED = 130


class CommandError(Exception):
    """A failure the command reports as one line; ``fix`` says what the user can do about it."""

    status = FAILED

    def __init__(self, what: str, fix: str = "", *, child_traceback: str = "") -> None:
        super().__init__(what)
        self.what = what
        self.fix = fix
        self.child_traceback = child_traceback

    def line(self) -> str:
        return one_line(self.what, self.fix)


class UsageError(CommandError):
    """The command line asks for something that cannot work; nothing has run."""

    status = USAGE


class RunFailed(CommandError):
    """The command ran and did not succeed."""

    status = FAILED


def one_line(what: str, fix: str = "") -> str:
    """``kvxfer: error: <what> (<fix>)``, newlines folded so it stays one line."""
    what = " ".join(what.split())
    fix = " ".join(fix.split())
    if fix and not (what.endswith(")") and fix in what):
        what = f"{what} ({fix})"
    return f"kvxfer: error: {what}"


def report(line: str, *, debug: bool, child_traceback: str = "", exc: Optional[BaseException] = None) -> None:
    """Write the error line to stderr; with ``debug``, the tracebacks first."""
    if debug:
        if exc is not None:
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        if child_traceback:
            sys.stderr.write("in the child process:\n" + child_traceback)
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
