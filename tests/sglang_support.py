"""Shared pieces of the SGLang backend tests: the SGLang environment, and SGLang ranks as real processes.

The tests run in the main environment; SGLang (0.5.23, CPU torch) lives in its own,
``.venv-sglang``, built by ``make test`` (``tools/bootstrap.sh``), or any Python named by
``KVXFER_SGLANG_PYTHON``. Each rank is ``tests/sglang_peer.py`` in that Python.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any, Optional

import pytest

REPO = Path(__file__).resolve().parent.parent
PEER = Path(__file__).resolve().parent / "sglang_peer.py"

#: The pool every test rank builds unless told otherwise (SGLang's MHA layout, page_size > 1).
POOL = {"tokens": 256, "page_size": 4, "heads": 2, "head_dim": 16, "layers": 3, "aux_rows": 16, "hidden": 32}


def sglang_python() -> str:
    """The SGLang environment's Python; fails (never skips) saying how to build it."""
    explicit = os.environ.get("KVXFER_SGLANG_PYTHON")
    candidate = Path(explicit) if explicit else REPO / ".venv-sglang" / "bin" / "python"
    stamp = candidate.parent.parent / ".kvxfer-installed"
    if not candidate.exists() or (not explicit and not stamp.exists()):
        pytest.fail("no SGLang environment: `make test` builds .venv-sglang (tools/bootstrap.sh, "
                    "KVXFER_SGLANG_ONLY=1 builds only it); or set KVXFER_SGLANG_PYTHON to a Python with "
                    "sglang==0.5.23 and kvxfer installed", pytrace=False)
    return str(candidate)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"KVXFER_TRANSFER_TIMEOUT_S": "5", "KVXFER_SGLANG_HEARTBEAT_S": "0.5",
                "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60",
                "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "60", "OMP_NUM_THREADS": "1",
                "PYTHONWARNINGS": "ignore"})
    env.update(extra)
    return env


class Peer:
    """One SGLang rank (``sglang_peer.py``) and its JSON line channel."""

    def __init__(self, role: str, backend: str, bootstrap_port: int, *, env: Optional[dict[str, str]] = None,
                 **pool: Any) -> None:
        cfg = {"role": role, "backend": backend, "bootstrap_port": bootstrap_port, **POOL, **pool}
        self.role = role
        self.proc = subprocess.Popen([sglang_python(), str(PEER), json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or peer_env(),
                                     cwd=str(REPO))
        self._lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self._lines), daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()
        self.info: dict[str, Any] = {}

    @staticmethod
    def _pump(stream: Any, out: "queue.Queue[Optional[str]]") -> None:
        for line in stream:
            out.put(line)
        out.put(None)

    def _pump_err(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)
            del self.stderr[:-400]

    def read(self, timeout_s: float = 120.0) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"{self.role}: no reply within {timeout_s}s; stderr:\n{self.log()}") from None
        if line is None:
            self.proc.wait(timeout=10)
            raise AssertionError(f"{self.role} exited ({self.proc.returncode}); stderr:\n{self.log()}")
        reply = json.loads(line)
        if "error" in reply:
            raise AssertionError(f"{self.role}: {reply['error']}\n{reply.get('traceback', '')}\n{self.log()}")
        return reply

    def ready(self, timeout_s: float = 150.0) -> "Peer":
        self.info = self.read(timeout_s)
        return self

    def send(self, **cmd: Any) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def ask(self, timeout_s: float = 120.0, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        return self.read(timeout_s)

    def log(self) -> str:
        return "".join(self.stderr[-60:])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(op="exit")
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait(timeout=10)


def rooms_plan(first_room: int, count: int, *, pages_per_room: int = 7, chunks: Any = (3, 4),
               src_base: int = 1, dst_base: int = 40, scatter: bool = True) -> tuple[list[dict], list[dict]]:
    """Matching prefill (``serve``) and decode (``receive``) room lists: distinct pages per room,
    the destination pages in another order and place than the source's (page reuse across rooms is
    what SGLang's allocator does; the test only needs them disjoint within one batch). ``chunks``: the
    pages of each chunk, one tuple for every room, or a list of tuples taken in turn room by room."""
    per_room = [tuple(chunks)] if isinstance(chunks[0], int) else [tuple(c) for c in chunks]
    serve, receive = [], []
    for i in range(count):
        src = [src_base + i * pages_per_room + k for k in range(pages_per_room)]
        dst = [dst_base + i * pages_per_room + k for k in range(pages_per_room)]
        if scatter:
            dst = dst[::2] + dst[1::2]
        serve.append({"room": first_room + i, "pages": src, "chunks": list(per_room[i % len(per_room)]),
                      "aux_index": i % 8})
        receive.append({"room": first_room + i, "pages": dst, "aux_index": 8 + i % 8})
    return serve, receive


def kvxfer_leftovers(managers: list[tuple[Peer, str]], peers: Any) -> list[str]:
    """What a run left that it must not: kvxfer's tables not empty on any of ``managers`` (``(rank, manager name)``,
    ``"main"`` for the rank's own; a prefill's asked after a short settle, for its read-done drain), and every
    ``KVArgs`` field SGLang left unset that kvxfer read on any of ``peers``."""
    faults = []
    for peer, name in managers:
        sizes = peer.ask(op="sizes", settle_s=0.3 if peer.role == "prefill" else 0.0,
                         **({} if name == "main" else {"manager": name}))["sizes"]
        if any(sizes.values()):
            faults.append(f"{peer.role} {name}: kvxfer's tables not empty: {sizes}")
    for peer in peers:
        reads = peer.ask(op="unset_reads")["unset_reads"]
        faults += [f"{peer.role}: kvxfer read KVArgs.{r[0]}, unset by SGLang" for r in reads if r[1].startswith("kvxfer")]
    return faults


def started(*peers: Peer) -> None:
    for peer in peers:
        peer.ready()


def push_frames(peer: "Peer", messages: list[list[bytes]], settle_s: float = 0.5) -> None:
    """Send ``messages`` to ``peer``'s SGLang socket as any host on the network can (a zmq PUSH), then give
    the rank ``settle_s`` to take them."""
    import time

    import zmq

    context = zmq.Context()
    try:
        sock = context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 10_000)
        sock.connect(peer.info["endpoint"])
        for message in messages:
            sock.send_multipart(message)
        sock.close()
    finally:
        context.term()  # waits (LINGER) until every frame went out
    time.sleep(settle_s)
