"""Process states for tests that stall a peer.

``os.kill(pid, SIGSTOP)`` returns before the kernel has stopped every thread of the target: on a
loaded machine a source can still serve a read posted right after it (CI saw "the stalled read
finished while its source was stopped"). ``stop`` returns once every thread is stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time


def all_threads_stopped(pid: int) -> bool:
    """Every thread of ``pid`` is in state T (stopped) or t (traced)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # the thread ended
        if state not in ("T", "t"):
            return False
    return True


def stop(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait until every one of its threads is stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not all_threads_stopped(pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} was sent SIGSTOP but not all its threads stopped in {timeout_s}s")
        time.sleep(0.001)


def close_stdin_and_wait(proc: "subprocess.Popen", timeout_s: float = 15.0) -> None:
    """End a helper process that serves commands on its stdin: close stdin and wait; kill it if it does not
    exit within ``timeout_s`` (or its pipe is already gone)."""
    if proc.poll() is not None:
        return
    try:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=timeout_s)
    except (subprocess.TimeoutExpired, OSError):
        proc.kill()
        proc.wait(timeout=timeout_s)
