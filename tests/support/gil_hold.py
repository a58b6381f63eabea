"""Holding a process's GIL in C, as vLLM's engine does through its long C calls (issue 40).

``ctypes.PyDLL`` does not release the GIL around a call, so ``hold_gil(S)`` sleeps ``S`` seconds in C
with the calling thread holding it: no other thread of the process (a handshake or confirmation thread, as
kvxfer had before it moved them into child processes) runs Python meanwhile. Tests use it to starve a real
source process."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from contextlib import contextmanager
from typing import Iterator


def hold_gil(seconds: float) -> None:
    """Sleep ``seconds`` in C (``usleep``) without letting go of the GIL."""
    ctypes.PyDLL(None).usleep(int(seconds * 1e6))


@contextmanager
def killed_after(pid: int, seconds: float) -> Iterator[list[float]]:
    """SIGKILL ``pid`` ``seconds`` from now, from a thread (a source killed during its hold); yields a list
    that gets the kill's ``time.monotonic()``, and waits for the kill on leaving."""
    killed_at: list[float] = []

    def kill() -> None:
        time.sleep(seconds)
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill)
    killer.start()
    try:
        yield killed_at
    finally:
        killer.join()
