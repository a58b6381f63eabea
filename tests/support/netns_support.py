"""Network namespaces as stand-in hosts: the shared helpers of the two-host tests.

Both tests need root and ``ip netns`` (CI runs as root). Where namespaces cannot be
made the tests fail with the reason instead of skipping: they are the only tests of
traffic between two hosts, and silence would hide that they did not run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from multiprocessing.connection import Client
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def namespaces_problem() -> str:
    """Why network namespaces cannot be created here ("" when they can)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    name = f"kvxprobe{os.getpid()}"
    try:
        ip("netns", "add", name)
        ip("netns", "del", name)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot create network namespaces here: {exc}"
    return ""


def require_namespaces() -> None:
    problem = namespaces_problem()
    if problem:
        pytest.fail(f"{problem} (the two-host tests run as root with `ip netns`)", pytrace=False)


class Peer:
    """A ``tests.support.netns_peer`` process in namespace ``ns``, and the authenticated Unix-socket connection
    to it. UCX runs over TCP on ``dev`` (``UCX_NET_DEVICES``; ``"all"``, UCX's default, for every interface)."""

    def __init__(self, role: str, ns: str, dev: str, backend: str, tmp: Path) -> None:
        from tests.support.netns_peer import AUTHKEY  # torch and the backends: only for the tests that start peers

        self.socket = str(tmp / f"{role}.sock")
        secret = tmp / "cluster.secret"  # two namespaces are two hosts: their metas must be signed
        if not secret.exists():
            secret.write_bytes(os.urandom(32).hex().encode())
            secret.chmod(0o600)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "UCX_TLS": "tcp", "UCX_NET_DEVICES": dev,
               "KVXFER_SECRET_FILE": str(secret)}
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "tests.support.netns_peer", role, self.socket, backend],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 90
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{role} did not start: {self.proc.stdout.read().decode()[-2000:]}")
            time.sleep(0.1)
        self.conn = Client(self.socket, family="AF_UNIX", authkey=AUTHKEY)
        _, self.meta = self.call_reply()

    def call_reply(self, *command, timeout: float = 60):
        if command:
            self.conn.send(command)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer did not answer {command[:1]} within {timeout}s")
        return self.conn.recv()

    def close(self) -> None:
        try:
            self.call_reply("quit", timeout=20)
        except (OSError, EOFError, TimeoutError):
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
