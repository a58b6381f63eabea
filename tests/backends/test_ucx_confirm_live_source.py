"""A ucx source that lives but answers its meta confirmation late costs latency, not the read (issue 40).

Without a cluster key a decode asks the process a same-host ucx meta names whether it exported it
(``kvxfer/backends/ucx/confirm.py``); a daemon thread of that process answers, so only when the
process's main thread lets go of the GIL. In real vLLM TP 1 -> 2 on this 2-core machine the prefill
worker answered after 16-30 s and the decode gave up at its fixed limit.

Real processes: a source (this file run as a script: a ``UcxBackend`` registered and its meta exported)
holds its GIL in C (``ctypes.PyDLL(None).usleep``: ``PyDLL`` does not release the GIL) while this process
confirms the meta the way the vLLM worker does ahead of its reads (``confirm_peer``, here with a 2 s
limit). A SIGKILLed source fails the confirmation at once; a SIGSTOPped one at the limit, as before.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch

from kvxfer.backends.ucx import confirm
from kvxfer.backends.ucx.backend import UcxBackend

pytestmark = pytest.mark.timeout(180)

SHAPE = (2, 2, 8, 16, 2, 32)
NUM_BLOCKS = 8
LIMIT_S = 2.0   # the confirmation's own limit here (the vLLM worker's is transfer_timeout_s)
HOLD_S = 8.0


class Source:
    """This file as a script: a registered ucx source that holds its GIL on ``hold S``."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the source exited ({self.proc.wait()})"
        self.meta: dict[str, Any] = json.loads(line)

    def hold(self, seconds: float) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"hold {seconds}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "holding"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def source() -> Any:
    confirm._confirmed.clear()
    confirm._failed.clear()
    src = Source()
    yield src
    src.close()


def _confirm(meta: dict[str, Any]) -> tuple[bool, float]:
    with UcxBackend("decode", torch.zeros(SHAPE), NUM_BLOCKS, timeout_s=10.0) as dst:
        began = time.monotonic()
        ok = dst.confirm_peer(meta, timeout_s=LIMIT_S)
        return ok, time.monotonic() - began


def test_a_live_source_holding_its_gil_is_confirmed_after_the_hold(source: Source) -> None:
    """Before: refused at the 2 s limit (``confirm_peer`` False, the loads failed). Now: confirmed once the
    source lets go of its GIL, ~8 s, because it lived all along."""
    source.hold(HOLD_S)
    ok, took = _confirm(source.meta)
    print(f"\nMEASURED confirmation during an {HOLD_S:g} s GIL hold of a live source: {ok} after {took:.2f} s")
    assert ok and LIMIT_S < took < HOLD_S + 5, (ok, took)


def test_a_source_killed_during_the_hold_fails_the_confirmation_at_once(source: Source) -> None:
    """Killed past the limit (so the wait was already extended): the confirmation fails within 1 s of it."""
    source.hold(HOLD_S)
    killed_at: list[float] = []

    def kill() -> None:
        time.sleep(LIMIT_S + 1.0)
        killed_at.append(time.monotonic())
        os.kill(source.proc.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill)
    killer.start()
    ok, _ = _confirm(source.meta)
    killer.join()
    late = time.monotonic() - killed_at[0]
    print(f"\nMEASURED confirmation of a source SIGKILLed during its hold: {ok}, {late:.2f} s after the kill")
    assert not ok and late < 1.0, (ok, late)


def test_a_stopped_source_still_fails_at_the_limit(source: Source) -> None:
    """SIGSTOP (state T): it cannot answer until someone resumes it, so it is not waited for past the limit."""
    os.kill(source.proc.pid, signal.SIGSTOP)
    try:
        ok, took = _confirm(source.meta)
    finally:
        os.kill(source.proc.pid, signal.SIGCONT)
    assert not ok and LIMIT_S - 0.1 < took < LIMIT_S + 1.5, (ok, took)


def _source_main() -> None:
    backend = UcxBackend(f"source-{os.getpid()}", torch.ones(SHAPE), NUM_BLOCKS)
    print(json.dumps(backend.export_meta()), flush=True)  # starts the confirmation thread
    for line in sys.stdin:
        command, *args = line.split()
        if command == "hold":
            print("holding", flush=True)
            ctypes.PyDLL(None).usleep(int(float(args[0]) * 1e6))  # in C, the GIL held: the confirm thread waits
    backend.close()


if __name__ == "__main__":
    _source_main()
