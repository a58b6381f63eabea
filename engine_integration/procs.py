"""Start helper processes as ``python -m <module> <payload fd> <ready fd>`` and wait for their first word.

Plain subprocesses rather than ``multiprocessing``: they never re-import the caller's
``__main__`` (so a script without an ``if __name__ == "__main__"`` guard still works),
and a test can SIGKILL one by pid like any real deployment would see it die.

The child reports readiness as one JSON line on a private pipe (``report``), not on
stdout: transports log to stdout, and the child's stdout is sent to our stderr so it
never mixes with a command's own output.

The payload (configs, and with them the cluster secret) travels the other way on an
inherited pipe (``read_payload``), never in argv: ``/proc/<pid>/cmdline`` is readable by
every local user.

(The library's loopback, soak and bench start their second process with
``kvxfer.harness.child`` instead: a function in a spawned interpreter that they converse with
over a duplex pipe until it ends. Here a process is a service: it reports ready once, then
serves on its own sockets until it is stopped.)
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

_ROOT = str(Path(__file__).resolve().parent.parent)
_READY_FDS: dict[int, int] = {}  # child pid -> our end of its ready pipe


class ProcessStartError(RuntimeError):
    """A helper process exited or stayed silent instead of reporting ready."""


def spawn(module: str, payload: Any, *, start_timeout_s: float = 60.0) -> tuple[subprocess.Popen, Any]:
    """Start ``module`` with ``payload`` (JSON) and return it with what it reported."""
    proc = launch(module, payload)
    return proc, wait_ready(proc, module, start_timeout_s)


def launch(module: str, payload: Any, *, prefix: Sequence[str] = (),
           extra_env: Optional[Mapping[str, str]] = None) -> subprocess.Popen:
    """Start ``module`` without waiting (start several, then ``wait_ready`` on each).

    ``prefix`` runs it under another command (e.g. ``ip netns exec NS``: the tests'
    stand-in for another host); ``extra_env`` is added to our environment.
    """
    env = {**os.environ, **(extra_env or {})}
    env["PYTHONPATH"] = os.pathsep.join([_ROOT, *filter(None, [env.get("PYTHONPATH")])])
    read_fd, write_fd = os.pipe()
    payload_read, payload_write = os.pipe()
    try:
        proc = subprocess.Popen([*prefix, sys.executable, "-m", module, str(payload_read), str(write_fd)],
                                stdin=subprocess.DEVNULL, stdout=2, pass_fds=(payload_read, write_fd), env=env)
    except BaseException:
        os.close(read_fd)
        os.close(payload_write)
        raise
    finally:
        os.close(write_fd)
        os.close(payload_read)
    # in a thread: a payload bigger than the pipe buffer must not block us before the child reads
    threading.Thread(target=_write_all, args=(payload_write, json.dumps(payload).encode()), daemon=True).start()
    _READY_FDS[proc.pid] = read_fd
    return proc


def _write_all(fd: int, data: bytes) -> None:
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
    except OSError:
        pass  # the child died first; wait_ready reports that


def read_payload(fd: int) -> Any:
    """Child side: the JSON payload the parent wrote on the inherited pipe ``fd``."""
    with os.fdopen(fd, "rb") as fh:
        return json.loads(fh.read())


def wait_ready(proc: subprocess.Popen, module: str, start_timeout_s: float) -> Any:
    """What ``proc`` reported; raises ``ProcessStartError`` if it exits or times out first."""
    fd = _READY_FDS.pop(proc.pid)
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + start_timeout_s
    data = b""
    try:
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                proc.kill()
                proc.wait(10)
                raise ProcessStartError(f"{module} did not report ready within {start_timeout_s}s")
            if sel.select(min(left, 0.5)):
                chunk = os.read(fd, 65536)
                if not chunk:
                    proc.wait(10)
                    raise ProcessStartError(f"{module} exited with status {proc.returncode} before reporting ready")
                data += chunk
    finally:
        sel.close()
        os.close(fd)
    return json.loads(data)


def report(payload: Any, fd: int) -> None:
    """Child side: the one line the parent waits for, on the pipe it passed us."""
    os.write(fd, (json.dumps(payload) + "\n").encode())
    os.close(fd)


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
