"""Start helper processes as ``python -m <module> <json>`` and wait for their first word.

Plain subprocesses rather than ``multiprocessing``: they never re-import the caller's
``__main__`` (so a script without an ``if __name__ == "__main__"`` guard still works),
and a test can SIGKILL one by pid like any real deployment would see it die.
The child prints exactly one JSON line on stdout (``report``) and nothing after it.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_ROOT = str(Path(__file__).resolve().parent.parent)


class ProcessStartError(RuntimeError):
    """A helper process exited or stayed silent instead of reporting ready."""


def spawn(module: str, payload: Any, *, start_timeout_s: float = 60.0) -> tuple[subprocess.Popen, Any]:
    """Start ``module`` with ``payload`` (JSON) and return it with the line it reported."""
    proc = launch(module, payload)
    return proc, wait_ready(proc, module, start_timeout_s)


def launch(module: str, payload: Any) -> subprocess.Popen:
    """Start ``module`` without waiting (start several, then ``wait_ready`` on each)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([_ROOT, *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.Popen([sys.executable, "-m", module, json.dumps(payload)], stdout=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, env=env)


def wait_ready(proc: subprocess.Popen, module: str, start_timeout_s: float) -> Any:
    """The JSON line ``proc`` reports; raises ``ProcessStartError`` if it exits or times out first."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + start_timeout_s
    line = b""
    try:
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                proc.kill()
                proc.wait(10)
                raise ProcessStartError(f"{module} did not report ready within {start_timeout_s}s")
            if sel.select(min(left, 0.5)):
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    proc.wait(10)
                    raise ProcessStartError(f"{module} exited with status {proc.returncode} before reporting ready")
                line += chunk
    finally:
        sel.close()
    proc.stdout.close()
    return json.loads(line)


def report(payload: Any) -> None:
    """Child side: the one line the parent waits for."""
    sys.stdout.write(json.dumps(payload) + "\n")
    sys.stdout.flush()
    devnull = open(os.devnull, "w")
    sys.stdout = devnull  # the parent stopped reading; keep stray prints from blocking us


def stop(proc: subprocess.Popen, timeout_s: float = 10.0, *, terminate_first: bool = False) -> None:
    """Wait for a graceful exit (unless ``terminate_first``), then SIGTERM, then SIGKILL."""
    actions = (proc.terminate, proc.kill) if terminate_first else (None, proc.terminate, proc.kill)
    for action in actions:
        if action is not None:
            action()
        try:
            proc.wait(timeout_s)
            return
        except subprocess.TimeoutExpired:
            continue
