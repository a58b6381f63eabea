"""A reader's per-peer tables stay bounded (issue 26, row 6).

Measured before: a reader that met 41 source processes one after another, 40 of them gone,
kept 41 ucx endpoints, rkeys and pidfds (its open fds 27 -> 67) and 41 nixl remote agents.
Here real source processes (``tests/support/pull_source.py``) are met one after another and ended;
the reader (this process) must forget each one that exited, keep its open fd count flat, cap
its table when sources stay alive (never dropping one with a read in flight), and still read
the next source byte-exact.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))

from pull_source import ForkedSources, SourceProcess, SourceSpec, global_kv, shard  # noqa: E402

from kvxfer.backends import construct_kv_transfer_backend_class  # noqa: E402

SHAPE = (2, 2, 8, 4, 2, 16)  # small: the point is how many sources, not how many bytes
NUM_BLOCKS = SHAPE[2]
ALL = list(range(NUM_BLOCKS))
SOURCES = 16


def open_fds() -> int:
    """This process's open fds, less pipes (the test's own pipes to its source processes)."""
    fds = os.listdir("/proc/self/fd")
    return sum(1 for fd in fds if not _readlink(f"/proc/self/fd/{fd}").startswith("pipe:"))


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def reader(backend: str, name: str) -> Any:
    cls = construct_kv_transfer_backend_class(backend)
    spec = SourceSpec(backend, name, 0, SHAPE, global_rank=100)
    return cls(name, torch.zeros(SHAPE, dtype=torch.bfloat16), NUM_BLOCKS, timeout_s=30.0, **spec.layout_kwargs())


def expected(spec: SourceSpec) -> torch.Tensor:
    return shard(spec, global_kv(spec.shape, spec.seed))


def read_exact(dst: Any, meta: dict, pool: torch.Tensor, request_id: str) -> None:
    dst.memory_buffer.zero_()
    dst.begin_pull_blocks(meta, ALL, ALL, request_id=request_id).wait()
    assert torch.equal(dst.memory_buffer.view(torch.int16), pool.view(torch.int16)), f"{request_id}: not exact"


def wait_until(predicate: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def started() -> Iterator[list[SourceProcess]]:
    sources: list[SourceProcess] = []
    yield sources
    for source in sources:
        if source.proc.poll() is None:
            source.close()


@pytest.mark.parametrize("backend", ["ucx", "nixl"])
def test_reader_forgets_sources_that_exited_and_keeps_its_fds_flat(backend, monkeypatch):
    """16 sources met one after another, each SIGKILLed once read: the reader forgets each within
    about a sweep, its fd count stays flat, and it reads the next source byte-exact."""
    monkeypatch.delenv("UCX_TLS", raising=False)
    forks = ForkedSources()
    try:
        with reader(backend, f"tables-{backend}-reader") as dst:
            counts, fds = [], []
            for i in range(SOURCES):
                spec = SourceSpec(backend, f"tables-{backend}-{i}", 100 + i, SHAPE)
                pid, meta = forks.start(spec)
                read_exact(dst, meta, expected(spec), f"r{i}")
                os.kill(pid, signal.SIGKILL)
                time.sleep(0.05)
                counts.append(dst.peer_count())
                fds.append(open_fds())
            # The last one is forgotten within a sweep (nixl sweeps when it pulls or drains).
            assert wait_until(lambda: (dst.drain_read_done(), dst.peer_count())[1] == 0, 5.0), dst.peer_count()
            print(f"{backend}: peers held after each source {counts}; reader fds {fds[0]} -> {fds[-1]} "
                  f"(max {max(fds)}); {dst.peers_dropped} dropped")
            assert max(counts) <= 3, counts  # each exited source forgotten within about a sweep
            assert max(fds) <= fds[0] + 6, fds
            spec = SourceSpec(backend, f"tables-{backend}-last", 7, SHAPE)
            _, meta = forks.start(spec)
            read_exact(dst, meta, expected(spec), "last")
    finally:
        forks.close()


def test_ucx_cap_evicts_idle_peers_never_one_with_a_read_in_flight(started, monkeypatch):
    """Over tcp a read needs its source's CPU, so a SIGSTOPped source holds its read in flight while
    the reader meets twice its cap of live sources: the others are evicted, least recently used
    first, that one never; it completes byte-exact once the source resumes, and an evicted source
    is read again (a new endpoint) byte-exact."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    stalled = SourceProcess(SourceSpec("ucx", "cap-stalled", 1, SHAPE, ucx_tls="tcp"))
    others = [SourceProcess(SourceSpec("ucx", f"cap-{i}", 10 + i, SHAPE, ucx_tls="tcp")) for i in range(6)]
    started.extend([stalled, *others])
    held, rest = ALL[:NUM_BLOCKS // 2], ALL[NUM_BLOCKS // 2:]
    with reader("ucx", "cap-reader") as dst:
        dst.max_peers = 3
        dst.begin_pull_blocks(stalled.meta, [0], [0]).wait()  # connected and confirmed
        stalled.stop()
        try:
            handle = dst.begin_pull_blocks(stalled.meta, held, held, request_id="held")
            counts = []
            for i, other in enumerate(others):
                dst.begin_pull_blocks(other.meta, rest, rest, request_id=f"o{i}").wait()
                assert torch.equal(dst.memory_buffer[:, :, rest].view(torch.int16),
                                   other.expected_pool()[:, :, rest].view(torch.int16)), f"o{i}: not exact"
                counts.append(dst.peer_count())
            assert not handle.poll(), "the stalled read finished while its source was stopped"
        finally:
            stalled.resume()
        handle.wait(30)
        assert torch.equal(dst.memory_buffer[:, :, held].view(torch.int16),
                           stalled.expected_pool()[:, :, held].view(torch.int16)), "the held read is not exact"
        print(f"ucx cap 3: peers held {counts}, {dst.peers_dropped} dropped")
        assert max(counts) <= 3 and dst.peers_dropped >= len(others) - 2, (counts, dst.peers_dropped)
        dst.begin_pull_blocks(others[0].meta, rest, rest, request_id="again").wait()  # evicted: connects anew
        assert torch.equal(dst.memory_buffer[:, :, rest].view(torch.int16),
                           others[0].expected_pool()[:, :, rest].view(torch.int16))
