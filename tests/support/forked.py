"""Helper processes of the main environment, forked from a server that imported torch once.

A helper (a source, a reader, a vLLM rank) is a real process of its own, but starting a fresh Python and
importing torch costs ~2 s of CPU, and the suite starts hundreds of them on 2 cores. ``start_helper`` forks
them from ``kvxfer.drive.forkserver``'s server for this Python (one per test process and startup settings),
which imported only ``PRELOAD``: never kvxfer's backends, UCX or NIXL, which must initialise in the helper.
What differs from a fresh process: the helper's parent is the fork server, and it ends with ``os._exit``
(no atexit handlers). ``KVXFER_TEST_FORKSERVER=0`` starts fresh processes instead.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import IO, Any, Mapping, Optional, Sequence

from kvxfer.drive.forkserver import popen_python

ROOT = Path(__file__).resolve().parents[2]
PRELOAD = ("torch", "numpy")


def _copy_stderr(stream: IO[str]) -> None:
    """The helper's stderr, line by line, onto ours (pytest shows it with a failure); a pipe nobody reads would
    block the helper once 64 KiB of logs filled it."""
    for line in stream:
        sys.stderr.write(line)


def start_helper(argv: Sequence[str], env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None) -> Any:
    """``argv`` (``sys.executable``, then ``-m MODULE ...`` or ``SCRIPT ...``) with text pipes on its stdin and
    stdout, its stderr copied onto ours: what ``subprocess.Popen(argv, stdin=PIPE, stdout=PIPE, text=True)``
    gives, started in milliseconds where the fork server runs."""
    proc = popen_python(argv, env=dict(os.environ if env is None else env), cwd=cwd or str(ROOT), preload=PRELOAD,
                        fork=os.environ.get("KVXFER_TEST_FORKSERVER", "1") != "0")
    threading.Thread(target=_copy_stderr, args=(proc.stderr,), daemon=True).start()
    return proc
