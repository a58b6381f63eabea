"""A ucx source whose threads cannot run still confirms its meta at once (issue 40).

Without a cluster key a decode asks the process a same-host ucx meta names whether it exported it
(``kvxfer/backends/ucx/confirm.py``). That answer came from a daemon thread of the source, so only when
its main thread let go of the GIL: in real vLLM TP 1 -> 2 on this 2-core machine the prefill worker
answered after 16-120 s. Now a child process of the source answers (``confirm_server.py``), on a socket
the source itself listens on, so the kernel still names the source.

Real processes: a source (this module run with ``-m``: a ``UcxBackend`` registered and its meta exported)
holds its GIL in C (``ctypes.PyDLL(None).usleep``: ``PyDLL`` does not release the GIL) while this process
confirms the meta the way the vLLM worker does ahead of its reads (``confirm_peer``, here with a 2 s
limit). Confirmed during the hold; a SIGKILLed source fails the confirmation at once and leaves no
listener behind; a SIGSTOPped one fails at the limit, as before; a forged digest is refused. Where the
child cannot start (``thread``: the source's ``spawn`` made to fail) its thread answers after the hold.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvxfer.backends.ucx import confirm
from kvxfer.backends.ucx.backend import UcxBackend
from kvxfer.errors import PeerMetadataError
from kvxfer.meta.seal import SEAL_FIELD
from tests.support.gil_hold import hold_gil, killed_after

pytestmark = pytest.mark.timeout(180)

SHAPE = (2, 2, 8, 16, 2, 32)
NUM_BLOCKS = 8
LIMIT_S = 2.0   # the confirmation's own limit here (the vLLM worker's is transfer_timeout_s)
HOLD_S = 8.0
ROOT = Path(__file__).resolve().parents[2]
MODULE = "tests.backends.test_ucx_confirm_live_source"


class Source:
    """This file as a module run (``-m``): a registered ucx source that holds its GIL on ``hold S``."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", MODULE, *args], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)  # -m: it imports tests.support
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the source exited ({self.proc.wait()})"
        self.meta: dict[str, Any] = json.loads(line)

    def hold(self, seconds: float) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"hold {seconds}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "holding"

    def children(self) -> list[int]:
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            return [int(pid) for pid in f.read().split()]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _fresh() -> None:
    confirm._confirmed.clear()
    confirm._failed.clear()


@pytest.fixture
def source() -> Any:
    _fresh()
    src = Source()
    yield src
    src.close()


@pytest.fixture
def thread_source() -> Any:
    """A source whose answering process could not start: its daemon thread answers."""
    _fresh()
    src = Source("thread")
    yield src
    src.close()


def _confirm(meta: dict[str, Any]) -> tuple[bool, float]:
    with UcxBackend("decode", torch.zeros(SHAPE), NUM_BLOCKS, timeout_s=10.0) as dst:
        began = time.monotonic()
        ok = dst.confirm_peer(meta, timeout_s=LIMIT_S)
        return ok, time.monotonic() - began


def _listening(name: str) -> bool:
    """Whether anything holds the abstract socket ``name`` (``/proc/net/unix`` shows it as ``@name``)."""
    with open("/proc/net/unix") as f:
        return any(line.split()[-1] == "@" + name for line in f.read().splitlines()[1:] if len(line.split()) > 7)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] not in ("Z", "X")
    except OSError:
        return False


def test_a_live_source_holding_its_gil_is_confirmed_during_the_hold(source: Source) -> None:
    """Before: confirmed only after the 8 s hold (its thread needed the GIL). Now: at once, by its child."""
    source.hold(HOLD_S)
    ok, took = _confirm(source.meta)
    print(f"\nMEASURED confirmation during an {HOLD_S:g} s GIL hold of a live source: {ok} after {took:.2f} s")
    assert ok and took < 1.0, (ok, took)
    assert source.proc.poll() is None  # still holding


def test_a_forged_digest_is_still_refused(source: Source) -> None:
    """The child answers only for what its exporter sent it: a digest it never exported is denied."""
    sealed = {k: v for k, v in source.meta.items() if k in source.meta[SEAL_FIELD]["keys"]}
    with pytest.raises(PeerMetadataError, match="did not export it"):
        confirm._ask(sealed, "0" * 64, LIMIT_S)
    confirm._ask(sealed, source.meta[SEAL_FIELD]["sha256"], LIMIT_S)  # the real one, on the same socket


def test_a_killed_source_fails_the_confirmation_at_once(source: Source) -> None:
    """SIGKILLed during its hold: the confirmation fails at once, not at the limit."""
    source.hold(HOLD_S)
    os.kill(source.proc.pid, signal.SIGKILL)
    source.proc.wait()
    ok, took = _confirm(source.meta)
    print(f"\nMEASURED confirmation of a SIGKILLed source: {ok} after {took:.2f} s")
    assert not ok and took < 1.0, (ok, took)


def test_the_answering_process_ends_with_its_source(source: Source) -> None:
    """The source SIGKILLed (nothing of it runs to stop its child): within ~1 s the child is gone and
    nothing listens on the meta's socket name any more."""
    name = source.meta[confirm.CONFIRM_FIELD]
    children = source.children()
    assert len(children) == 1 and _listening(name), (children, name)
    os.kill(source.proc.pid, signal.SIGKILL)
    source.proc.wait()
    killed = time.monotonic()
    while (_alive(children[0]) or _listening(name)) and time.monotonic() - killed < 5.0:
        time.sleep(0.01)
    took = time.monotonic() - killed
    print(f"\nMEASURED the answering process gone {took:.2f} s after its source's SIGKILL")
    assert not _alive(children[0]) and not _listening(name) and took < 1.0, took
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe, pytest.raises(ConnectionRefusedError):
        probe.connect(b"\0" + name.encode())


def test_a_stopped_source_still_fails_at_the_limit(source: Source) -> None:
    """SIGSTOP (state T): its child answers no one meanwhile (the source could not serve the read either),
    so it is not waited for past the limit; resumed, it is confirmed at once."""
    os.kill(source.proc.pid, signal.SIGSTOP)
    try:
        ok, took = _confirm(source.meta)
    finally:
        os.kill(source.proc.pid, signal.SIGCONT)
    assert not ok and LIMIT_S - 0.1 < took < LIMIT_S + 1.5, (ok, took)
    _fresh()
    ok, took = _confirm(source.meta)
    assert ok and took < 1.0, (ok, took)


def test_without_the_child_a_live_source_holding_its_gil_is_confirmed_after_the_hold(thread_source: Source) -> None:
    """The fallback thread: refused at the 2 s limit before issue 40; confirmed once the source lets go of
    its GIL, ~8 s, because it lived all along."""
    assert thread_source.children() == []
    thread_source.hold(HOLD_S)
    ok, took = _confirm(thread_source.meta)
    print(f"\nMEASURED fallback thread: confirmation during an {HOLD_S:g} s GIL hold: {ok} after {took:.2f} s")
    assert ok and LIMIT_S < took < HOLD_S + 5, (ok, took)


def test_without_the_child_a_source_killed_during_the_hold_fails_the_confirmation_at_once(
        thread_source: Source) -> None:
    """Killed past the limit (so the wait was already extended): the confirmation fails within 1 s of it."""
    thread_source.hold(HOLD_S)
    with killed_after(thread_source.proc.pid, LIMIT_S + 1.0) as killed_at:
        ok, _ = _confirm(thread_source.meta)
    late = time.monotonic() - killed_at[0]
    print(f"\nMEASURED fallback thread: a source SIGKILLed during its hold: {ok}, {late:.2f} s after the kill")
    assert not ok and late < 1.0, (ok, late)


def _source_main(*args: str) -> None:
    if args == ("thread",):
        confirm.spawn = lambda listener, start_s: None  # as where the child cannot start
    backend = UcxBackend(f"source-{os.getpid()}", torch.ones(SHAPE), NUM_BLOCKS)
    print(json.dumps(backend.export_meta()), flush=True)  # starts the confirmation server
    for line in sys.stdin:
        command, *rest = line.split()
        if command == "hold":
            print("holding", flush=True)
            hold_gil(float(rest[0]))  # in C, the GIL held: no thread of this process runs meanwhile
    backend.close()


if __name__ == "__main__":
    _source_main(*sys.argv[1:])
