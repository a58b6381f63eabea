"""The producer's handshake is answered by a process of its own, so an engine that holds the GIL cannot starve it.

Issue 40: in real vLLM TP 1 -> 2 on this 2-core machine the handshake listener, a thread of vLLM's
engine-core process, accepted a decode's connection at 0.02 s and answered at 60.21 s, after the decode
ranks had given up: a thread of that process runs only when vLLM's engine thread lets go of the GIL.

Real processes, no vLLM: a stand-in for the engine-core process (this file run as a script) serves a
handshake the way the scheduler does (``HandshakeServer``: the port bound there, served by
``python -m kvxfer.integrations.vllm.handshake_server``), then holds its GIL in C for several seconds
(``ctypes.PyDLL(None).usleep``: ``PyDLL`` does not release the GIL), as vLLM's engine thread does through a
long custom op; this process fetches the handshake meanwhile. The same stand-in serving with the listener
on a thread of its own (the old way) shows that the hold does starve a thread.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest

from kvxfer.integrations.vllm.side_channel import fetch_handshake
from tests.support.proc_state import close_stdin_and_wait

pytestmark = pytest.mark.timeout(120)

HOLD_S = 8.0
REPO = Path(__file__).resolve().parents[3]
DOCUMENT = {"engine": "stand-in", "pad": "x" * 4096}


class StandIn:
    """This file as a script: the engine-core stand-in, serving ``DOCUMENT`` on a ``thread`` or a ``process``."""

    def __init__(self, mode: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.integrations.vllm.test_vllm_handshake_process", mode],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(REPO))
        info = self.read()
        self.port: int = info["port"]
        self.server_pid: Optional[int] = info["pid"]

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the stand-in exited ({self.proc.wait()})"
        return json.loads(line)

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        close_stdin_and_wait(self.proc)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _wait_gone(pid: int, within_s: float) -> float:
    began = time.monotonic()
    while not _gone(pid):
        assert time.monotonic() - began < within_s, f"the handshake process {pid} still runs after {within_s}s"
        time.sleep(0.02)
    return time.monotonic() - began


def _fetch_during_hold(mode: str) -> float:
    standin = StandIn(mode)
    try:
        assert fetch_handshake("127.0.0.1", standin.port, 5.0) == DOCUMENT  # warm: served before the hold
        assert standin.ask(f"hold {HOLD_S}") == {"holding": HOLD_S}
        # it said so before entering the hold, and writing the line let go of the GIL: give its main thread
        # time to take it back and enter the hold (a fetch in between was served at once: the control failed)
        time.sleep(0.5)
        began = time.monotonic()
        assert fetch_handshake("127.0.0.1", standin.port, 3 * HOLD_S) == DOCUMENT
        return time.monotonic() - began
    finally:
        standin.close()


def test_handshake_is_answered_while_the_engine_process_holds_its_gil() -> None:
    """Before (the listener a thread of the engine's process): answered only once the GIL was let go, after
    ~8 s; now within 1 s, during the hold."""
    took = _fetch_during_hold("process")
    print(f"\nMEASURED handshake fetch during an {HOLD_S:g} s GIL hold, served by its own process: {took:.3f} s")
    assert took < 1.0, took


def test_a_listener_thread_in_the_engine_process_is_starved_by_the_hold() -> None:
    """The control: the same hold starves a listener thread of the holding process (the old design), so the
    test above measures the fix, not a hold that starves nothing."""
    took = _fetch_during_hold("thread")
    print(f"\nMEASURED handshake fetch during an {HOLD_S:g} s GIL hold, served by a thread of it: {took:.3f} s")
    assert took > HOLD_S - 2.5, took


def test_the_handshake_process_reports_its_counters_and_exits_with_the_connector() -> None:
    """The listener's counters reach the parent, and the child exits when the connector closes it."""
    standin = StandIn("process")
    try:
        pid = standin.server_pid
        assert pid is not None and not _gone(pid)
        for _ in range(3):
            fetch_handshake("127.0.0.1", standin.port, 5.0)
        deadline = time.monotonic() + 5
        while (counters := standin.ask("counters"))["served"] < 3:
            assert time.monotonic() < deadline, counters
            time.sleep(0.1)
        assert counters["refused"] == counters["junk"] == counters["dropped"] == 0, counters
    finally:
        standin.close()
    assert standin.proc.returncode == 0
    _wait_gone(pid, 5.0)


def test_the_handshake_process_exits_when_its_parent_is_killed() -> None:
    """SIGKILL of the engine's process (no shutdown hook runs): its handshake process ends on stdin EOF, and
    the port is free again (nobody answers on it: a decode is refused at once, not left waiting)."""
    standin = StandIn("process")
    pid, port = standin.server_pid, standin.port
    assert pid is not None
    standin.proc.send_signal(signal.SIGKILL)
    standin.proc.wait()
    took = _wait_gone(pid, 5.0)
    print(f"\nMEASURED handshake process gone {took:.3f} s after its parent's SIGKILL")
    with pytest.raises(Exception, match="refused|failed"):
        fetch_handshake("127.0.0.1", port, 2.0)


def _served(standin: StandIn, count: int) -> None:
    deadline = time.monotonic() + 5
    while (counters := standin.ask("counters"))["served"] < count:
        assert time.monotonic() < deadline, counters
        time.sleep(0.1)


def _restarted(standin: StandIn, old_pid: int, within_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + within_s
    while (now := standin.ask("pid"))["pid"] == old_pid:
        assert time.monotonic() < deadline, f"the handshake process was not started again within {within_s}s"
        time.sleep(0.05)
    return now


def test_a_killed_handshake_process_is_started_again_while_the_engine_lives() -> None:
    """Issue 49: before, a handshake process SIGKILLed while the engine lived left the port closed, and every
    new decode's fetch was refused until the engine restarted. Now a fetch right after the kill is answered
    (it waits in the backlog of the socket the engine kept), by a new process serving the same document, and
    the counters of the dead one carry over."""
    standin = StandIn("process")
    try:
        pid = standin.server_pid
        assert pid is not None
        assert fetch_handshake("127.0.0.1", standin.port, 5.0) == DOCUMENT
        _served(standin, 1)  # reported before the kill (what a child had no time to report dies with it)
        os.kill(pid, signal.SIGKILL)
        began = time.monotonic()
        assert fetch_handshake("127.0.0.1", standin.port, 10.0) == DOCUMENT
        took = time.monotonic() - began
        now = _restarted(standin, pid, 10.0)
        print(f"\nMEASURED handshake fetch right after its process's SIGKILL: answered in {took:.3f} s by the new "
              f"process {now['pid']}")
        assert now["restarts"] == 1 and not _gone(now["pid"]), now
        _served(standin, 2)  # the dead process's count and the new one's
    finally:
        standin.close()
    _wait_gone(now["pid"], 5.0)


def test_a_handshake_process_that_keeps_dying_is_given_up_loudly() -> None:
    """More deaths than ``MAX_RESTARTS`` within ``RESTART_WINDOW_S`` are no mishap: the engine says so and closes
    the port, so that decodes are refused at once rather than left waiting in a backlog nobody serves."""
    from kvxfer.integrations.vllm.handshake_server import MAX_RESTARTS

    standin = StandIn("process")
    try:
        pid = standin.server_pid
        assert pid is not None
        for _ in range(MAX_RESTARTS):
            os.kill(pid, signal.SIGKILL)
            pid = _restarted(standin, pid, 10.0)["pid"]
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid, 5.0)
        deadline = time.monotonic() + 5
        while True:  # the watcher closes the socket as soon as it saw the death
            try:
                fetch_handshake("127.0.0.1", standin.port, 0.5)
            except Exception as exc:  # noqa: BLE001 - refused at once once the socket is closed
                if "refused" in str(exc):
                    break
            assert time.monotonic() < deadline, "the port still accepts after the handshake process was given up"
            time.sleep(0.1)
        assert standin.ask("pid") == {"pid": pid, "restarts": MAX_RESTARTS}
    finally:
        standin.close()
    assert standin.proc.returncode == 0


def test_the_handshake_process_imports_nothing_heavy() -> None:
    """No torch, no vLLM, no numpy in the child (``-X importtime``): it starts in tens of milliseconds."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import kvxfer.integrations.vllm.handshake_server"],
                         capture_output=True, text=True, check=True).stderr
    modules = {line.rsplit("|", 1)[1].strip() for line in out.splitlines() if line.startswith("import time:")}
    heavy = {m for m in modules if m.split(".")[0] in ("torch", "vllm", "numpy", "zmq", "nixl", "transformers")}
    assert not heavy, sorted(heavy)
    assert "kvxfer.integrations.vllm.side_channel" in modules


def _stand_in(mode: str) -> None:
    """The engine-core stand-in (``python -m`` from the repository, for ``tests.support``): serve, then on
    ``hold S`` hold the GIL in C for S seconds."""
    document = json.dumps(DOCUMENT).encode()
    if mode == "thread":
        from kvxfer.integrations.vllm.side_channel import HandshakeListener

        server: Any = HandshakeListener("127.0.0.1", 0, lambda: document, local_peers_only=True)
    else:
        from kvxfer.integrations.vllm.handshake_server import HandshakeServer

        server = HandshakeServer("127.0.0.1", 0, document, local_peers_only=True)
    print(json.dumps({"port": server.port, "pid": getattr(server, "pid", None)}), flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "hold":
            print(json.dumps({"holding": float(args[0])}), flush=True)
            ctypes.PyDLL(None).usleep(int(float(args[0]) * 1e6))  # in C, the GIL held: nothing else here runs
        elif command == "counters":
            print(json.dumps(server.counters()), flush=True)
        elif command == "pid":
            print(json.dumps({"pid": server.pid, "restarts": server.restarts}), flush=True)
    server.close()
    os._exit(0)


if __name__ == "__main__":
    _stand_in(sys.argv[1])
