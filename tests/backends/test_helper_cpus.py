"""kvxfer's helper processes leave the scheduling group and the CPU mask of the engine that starts them
(``kvxfer.backends.helper_cpus``, whose docstring has what real vLLM showed on this machine: a prefill rank's
ucx confirmation child runnable and unscheduled for 120 s, and the decode giving up on a live source).

Each case runs in a process of its own whose thread is pinned to one core, as vLLM's CPU worker pins a rank,
and starts the real helpers there: the ucx confirmation server and the vLLM producer's handshake server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, os, subprocess, sys
os.sched_setaffinity(0, {0})  # as an engine pins a rank's thread
from kvxfer.backends.ucx.confirm import confirm_server
from kvxfer.integrations.vllm.handshake_server import HandshakeServer

confirm = confirm_server()
handshake = HandshakeServer("127.0.0.1", 0, b"{}", local_peers_only=True)
plain = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
pids = {"confirm": confirm._child.pid, "handshake": handshake.pid, "plain": plain.pid, "own": os.getpid()}
print(json.dumps({name: {"mask": sorted(os.sched_getaffinity(pid)), "session": os.getsid(pid)}
                  for name, pid in pids.items()}))
plain.stdin.close(); plain.wait(); handshake.close(); confirm.close()
"""


def test_helpers_leave_their_engines_core_and_session():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    everywhere = sorted(os.sched_getaffinity(0))  # what this machine's cpuset lets a process run on
    assert got["own"]["mask"] == [0]  # the engine's thread stays pinned
    assert got["plain"]["mask"] == [0] and got["plain"]["session"] == got["own"]["session"]  # what a child inherits
    for helper in ("confirm", "handshake"):
        assert got[helper]["mask"] == everywhere, got
        assert got[helper]["session"] not in (got["own"]["session"], got["plain"]["session"]), got  # a group of its own
