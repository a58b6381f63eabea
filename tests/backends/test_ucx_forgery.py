"""A re-sealed same-host forgery on ucx, without a cluster key (issue 21, section 3).

Without ``KVXFER_SECRET_FILE`` a seal is a checksum anyone can recompute. A process of this host
took a real source's meta, pointed it at its own worker and memory (or at other rows of the
real source), sealed it again, and the decode read the forger's bytes as the request's KV.
Now the process a meta names must confirm, over a Unix socket whose peer the kernel vouches
for (``SO_PEERCRED``), that it exported exactly that meta (``kvxfer/backends/ucx/confirm.py``).

Real processes: a source and a forger (``tests/support/ucx_peer.py``), the decode in this process.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))

from ucx_peer import make_pool, source_main  # noqa: E402

from kvxfer.backends.ucx.backend import UcxBackend  # noqa: E402
from kvxfer.backends.ucx import confirm  # noqa: E402
from kvxfer.backends.ucx.confirm import CONFIRM_FIELD  # noqa: E402
from kvxfer.backends.same_host import PID_FIELD, START_FIELD  # noqa: E402
from kvxfer.errors import PeerMetadataError  # noqa: E402
from kvxfer.meta.seal import SEAL_FIELD, seal_meta  # noqa: E402

NUM_BLOCKS = 12
SHAPE = (2, 2, NUM_BLOCKS, 16, 2, 32)
SENTINEL = 7.0
IDS = [1, 2, 3]
_MP = mp.get_context("forkserver")
_MP.set_forkserver_preload(["torch", "kvxfer.backends.ucx"])


class Peer:
    """A process that registered one pool (seeded: the bytes it serves are known) and exported its meta."""

    def __init__(self, seed: int) -> None:
        self.conn, child = _MP.Pipe()
        self.proc = _MP.Process(target=source_main, args=(child, SHAPE, ["float32"], NUM_BLOCKS, seed, {}), daemon=True)
        self.proc.start()
        assert self.conn.poll(60), "the peer process did not start"
        _, metas, self.pid = self.conn.recv()
        self.meta = metas[0]
        self.pool = make_pool(SHAPE, torch.float32, seed)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send("exit")
            self.conn.poll(10) and self.conn.recv()
        self.proc.join(10)


@pytest.fixture(scope="module")
def peers() -> Iterator[tuple[Peer, Peer]]:
    source, forger = Peer(seed=1), Peer(seed=99)
    yield source, forger
    source.stop()
    forger.stop()


@pytest.fixture(autouse=True)
def _nothing_confirmed_yet() -> None:
    """Each test starts as a process that has confirmed no meta (confirmations are per process)."""
    confirm._confirmed.clear()


def _decode() -> UcxBackend:
    return UcxBackend("decode", torch.full(SHAPE, SENTINEL), NUM_BLOCKS, timeout_s=10.0)


def _resealed(meta: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return seal_meta({**{k: v for k, v in meta.items() if k != SEAL_FIELD}, **changes})


def _untouched(dst: UcxBackend) -> bool:
    return bool(torch.equal(dst.memory_buffer, torch.full(SHAPE, SENTINEL)))


def _pull_exact(dst: UcxBackend, meta: dict[str, Any], want: torch.Tensor, request_id: int) -> None:
    handle = dst.begin_pull_blocks(meta, IDS, IDS, request_id=request_id)
    handle.wait()
    assert handle.storage_safe
    assert torch.equal(dst.memory_buffer[:, :, IDS], want[:, :, IDS])


def _forgeries(source: Peer, forger: Peer) -> dict[str, dict[str, Any]]:
    real, own = source.meta, forger.meta
    return {
        # the real source's identity, the forger's worker and memory: the forger's bytes would land
        "forger's worker and rkey": _resealed(real, ucx_worker_address=own["ucx_worker_address"],
                                              ucx_rkey=own["ucx_rkey"], base_addr=own["base_addr"]),
        # the real source's worker, other rows of its memory: another request's bytes would land
        "buffer shifted by one block": _resealed(real, base_addr=real["base_addr"] + 16 * 2 * 32 * 4),
        # the forger's meta, claiming to be the source's process
        "forger's meta naming the source's pid": _resealed(own, **{PID_FIELD: real[PID_FIELD],
                                                                   START_FIELD: real[START_FIELD]}),
        "confirm field removed": seal_meta({k: v for k, v in real.items() if k not in (SEAL_FIELD, CONFIRM_FIELD)}),
    }


@pytest.mark.parametrize("how", ["forger's worker and rkey", "buffer shifted by one block",
                                 "forger's meta naming the source's pid", "confirm field removed"])
def test_a_resealed_forgery_is_refused_before_a_byte_moves(peers: tuple[Peer, Peer], how: str) -> None:
    source, forger = peers
    with _decode() as dst:
        with pytest.raises(PeerMetadataError, match="peer meta refused"):
            dst.begin_pull_blocks(_forgeries(source, forger)[how], IDS, IDS, request_id=1)
        assert _untouched(dst) and dst.stats()["in_flight"] == 0
        _pull_exact(dst, source.meta, source.pool, request_id=2)   # the real meta still works
        assert dst.sources_confirmed == 1


def test_without_the_check_the_forgery_lands_the_forgers_bytes(peers: tuple[Peer, Peer],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The attack is real: with the confirmation switched off, the decode reads the forger's bytes."""
    source, forger = peers
    monkeypatch.setattr(UcxBackend, "_check_peer_source", lambda self, sealed, digest: None)
    with _decode() as dst:
        handle = dst.begin_pull_blocks(_forgeries(source, forger)["forger's worker and rkey"], IDS, IDS, request_id=3)
        handle.wait()
        assert torch.equal(dst.memory_buffer[:, :, IDS], forger.pool[:, :, IDS])
        assert not torch.equal(dst.memory_buffer[:, :, IDS], source.pool[:, :, IDS])


def test_a_socket_named_for_the_source_but_held_by_another_process_is_refused(peers: tuple[Peer, Peer]) -> None:
    """A squatter binds a confirmation socket in the source's name and answers yes to everything."""
    source, forger = peers
    name = f"kvxfer-ucx-confirm/{source.pid}/squatter"
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(b"\0" + name.encode())
    squatter.listen(8)
    stop = threading.Event()

    def say_yes() -> None:
        squatter.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = squatter.accept()
            except OSError:
                continue
            with conn:
                try:
                    conn.recv(128)
                    conn.sendall(b"yes\n")
                except OSError:   # the reader hung up on seeing who holds the socket
                    pass

    thread = threading.Thread(target=say_yes, daemon=True)
    thread.start()
    try:
        forged = _resealed(source.meta, ucx_worker_address=forger.meta["ucx_worker_address"],
                           ucx_rkey=forger.meta["ucx_rkey"], base_addr=forger.meta["base_addr"], **{CONFIRM_FIELD: name})
        with _decode() as dst:
            with pytest.raises(PeerMetadataError, match="held by pid"):
                dst.begin_pull_blocks(forged, IDS, IDS, request_id=4)
            assert _untouched(dst)
    finally:
        stop.set()
        thread.join(5)
        squatter.close()


def test_the_real_meta_is_confirmed_once_and_travels_any_wire(peers: tuple[Peer, Peer]) -> None:
    """One confirmation per meta (about a socket round trip), none for later pulls or a copy of it."""
    import json

    source, _ = peers
    with _decode() as dst:
        t0 = time.perf_counter()
        _pull_exact(dst, source.meta, source.pool, request_id=5)
        first = time.perf_counter() - t0
        for n in range(3):
            _pull_exact(dst, json.loads(json.dumps(source.meta)), source.pool, request_id=6 + n)
        assert dst.sources_confirmed == 1
    sealed = {k: v for k, v in source.meta.items() if k in source.meta[SEAL_FIELD]["keys"]}
    rounds = []
    for _ in range(20):
        t0 = time.perf_counter()
        confirm._ask(sealed, source.meta[SEAL_FIELD]["sha256"], 5.0)   # the round trip itself, no cache
        rounds.append(time.perf_counter() - t0)
    print(f"\nMEASURED a confirmation round trip: median {sorted(rounds)[10] * 1e6:.0f} us "
          f"(first pull through the meta, endpoint included: {first * 1e3:.2f} ms)")


def test_idle_connections_to_the_confirmation_socket_do_not_block_a_reader(peers: tuple[Peer, Peer]) -> None:
    """300 connections that never ask: the source sheds them and still answers a real reader."""
    source, _ = peers
    name = b"\0" + source.meta[CONFIRM_FIELD].encode()
    idle = []
    try:
        for _ in range(300):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(name)
            idle.append(s)
        with _decode() as dst:
            t0 = time.monotonic()
            _pull_exact(dst, source.meta, source.pool, request_id=10)
            assert time.monotonic() - t0 < 3.0
            assert dst.sources_confirmed == 1
    finally:
        for s in idle:
            s.close()


def test_with_the_cluster_key_nothing_is_asked(peers: tuple[Peer, Peer], monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    """A signed meta is authenticated by its HMAC; no confirmation round trip is made."""
    from kvxfer.security.auth import new_secret_file

    monkeypatch.setenv("KVXFER_SECRET_FILE", new_secret_file(str(tmp_path)))
    pool = make_pool(SHAPE, torch.float32, 5)
    with UcxBackend("signed-source", pool.clone(), NUM_BLOCKS) as src, _decode() as dst:
        _pull_exact(dst, src.export_meta(), pool, request_id=11)
        assert dst.sources_confirmed == 0
        forged = seal_meta({k: v for k, v in src.export_meta().items() if k != SEAL_FIELD})   # unsigned
        with pytest.raises(PeerMetadataError, match="not signed"):
            dst.begin_pull_blocks(forged, IDS, IDS, request_id=12)


def test_a_stopped_source_at_first_contact_fails_the_pull_plainly_before_anything_is_posted(
        peers: tuple[Peer, Peer]) -> None:
    """The confirmation waits at most the backend's timeout; then a plain ``TransferError`` (not a
    timeout: nothing was posted, so a caller such as Megatron may free the blocks at once)."""
    import os
    import signal

    from kvxfer.errors import TransferError, TransferTimeoutError

    from tests.support.proc_state import stop as stop_process

    source, _ = peers
    stop_process(source.pid)  # every thread stopped: its confirmation server cannot answer
    try:
        with UcxBackend("decode", torch.full(SHAPE, SENTINEL), NUM_BLOCKS, timeout_s=0.5) as dst:
            t0 = time.monotonic()
            with pytest.raises(TransferError, match="could not confirm") as caught:
                dst.begin_pull_blocks(source.meta, IDS, IDS, request_id=20)
            assert not isinstance(caught.value, TransferTimeoutError) and time.monotonic() - t0 < 2.0
            assert _untouched(dst) and dst.stats()["in_flight"] == 0
    finally:
        os.kill(source.pid, signal.SIGCONT)
    with _decode() as dst:
        _pull_exact(dst, source.meta, source.pool, request_id=21)
