"""Shared pieces of the SGLang backend tests: the SGLang environment, and SGLang ranks as real processes.

The tests run in the main environment; SGLang (0.5.23, CPU torch) lives in its own,
``.venv-sglang``, built by ``make test`` (``tools/bootstrap.sh``), or any Python named by
``KVXFER_SGLANG_PYTHON``. Each rank is ``tests/support/sglang_peer.py`` in that Python: kvxfer's own SGLang rank
(``kvxfer.drive.sglang_rank``, which ``kvxfer bench-sglang`` runs), its controller (``SglangRank``), the pool it
builds (``POOL``) and the room plans (``rooms_plan``) from ``kvxfer.drive.sglang_control``, plus the tests' own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import pytest

from kvxfer.drive.sglang_control import POOL, SglangRank, free_port, rank_env, rooms_plan  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
PEER = Path(__file__).resolve().parent / "sglang_peer.py"


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


def peer_env(**extra: str) -> dict[str, str]:
    """A test rank's environment: short timeouts and heartbeats, so failures show in seconds."""
    return rank_env(**{"KVXFER_TRANSFER_TIMEOUT_S": "5", "KVXFER_SGLANG_HEARTBEAT_S": "0.5",
                       "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
                       "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "60",
                       **extra})


class Peer(SglangRank):
    """One SGLang rank (``sglang_peer.py``: kvxfer's ``kvxfer.drive.sglang_rank`` with the tests' commands) and
    its JSON line channel; a failed read is an ``AssertionError``."""

    error = AssertionError

    def __init__(self, role: str, backend: str, bootstrap_port: int, *, env: Optional[dict[str, str]] = None,
                 **pool: Any) -> None:
        super().__init__(role, backend, bootstrap_port, env=env or peer_env(), command=[sglang_python(), str(PEER)],
                         **pool)


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
        faults += [f"{peer.role}: kvxfer read KVArgs.{r[0]}, unset by SGLang" for r in reads
                   if r[1].startswith("kvxfer.integrations")]
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
