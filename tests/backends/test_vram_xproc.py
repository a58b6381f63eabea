"""The product's own path: a decode process reads a prefill process's pool, pool to pool.

Every test here runs two (or three) OS processes: sources from ``tests/support/pull_source.py``
and the reader in this process. Each is parametrized by device: ``cuda`` (marked ``gpu``:
both pools in VRAM on ``cuda:0``, which is what kvxfer is for, and what no single-process
test covers) and ``cpu``, the same code on host memory, which keeps the test itself
honest on machines without a GPU. Every byte of the destination pool is compared, the
source's read-done is waited for, and a killed source must leave the destination
``storage_safe`` and the reader able to serve the next request.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))

from pull_source import SourceProcess, SourceSpec, closing_sources, global_kv  # noqa: E402

from kvxfer.backends import construct_kv_transfer_backend_class  # noqa: E402
from kvxfer.errors import TransferError  # noqa: E402
from kvxfer.runtime.multi_pull import begin_pull_from_peers  # noqa: E402

#: bf16 [2, L, B, T, H, d]; one (block, plane) slice is 16 KiB, the pool 12 MiB
SHAPE = (2, 4, 48, 16, 8, 64)
NUM_BLOCKS = SHAPE[2]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
BACKENDS = ["nixl", "ucx"]
SETTLE_S = 15.0


@pytest.fixture
def sources() -> Iterator[list[SourceProcess]]:
    """Sources a test starts; all resumed and closed at the end, whatever happened."""
    with closing_sources() as started:
        yield started


def start(sources: list[SourceProcess], backend: str, name: str, device: str, **layout: Any) -> SourceProcess:
    source = SourceProcess(SourceSpec(backend, name, 11, SHAPE, device=device, **layout))
    sources.append(source)
    return source


def reader(backend: str, name: str, device: str) -> Any:
    """The decode side: the whole model (TP 1), its pool zeroed on ``device``."""
    layout = SourceSpec(backend, name, 0, SHAPE, global_rank=100).layout_kwargs()
    cls = construct_kv_transfer_backend_class(backend)
    return cls(name, torch.zeros(SHAPE, dtype=torch.bfloat16, device=device), NUM_BLOCKS, timeout_s=30.0, **layout)


def expected_after(src_ids: list[int], dst_ids: list[int]) -> torch.Tensor:
    """The reader's whole pool after the pull: the source's blocks at ``dst_ids``, zeros elsewhere."""
    want = torch.zeros(SHAPE, dtype=torch.bfloat16)
    want[:, :, dst_ids] = global_kv(SHAPE, 11)[:, :, src_ids]
    return want


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.detach().cpu().contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def ids_for(pattern: str) -> tuple[list[int], list[int]]:
    """Scattered: a permutation on each side (one descriptor per block); contiguous: one run per plane."""
    if pattern == "contiguous":
        return list(range(8, 40)), list(range(4, 36))
    perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(5)).tolist()
    return perm[:20], perm[20:40]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", ["scattered", "contiguous"])
def test_pull_between_processes_is_byte_exact_and_reports_read_done(backend, device, pattern, sources):
    src = start(sources, backend, f"vram-{backend}-{pattern}", device)
    src_ids, dst_ids = ids_for(pattern)
    with reader(backend, f"vram-{backend}-{pattern}-reader", device) as dst:
        assert dst.memory_buffer.device.type == device
        dst.begin_pull_blocks(src.meta, src_ids, dst_ids, request_id="req-1").wait(timeout_s=60)
        if device == "cuda":
            torch.cuda.synchronize()
        assert same_bytes(dst.memory_buffer, expected_after(src_ids, dst_ids)), "bytes differ (or a block outside the request changed)"
    done, failed = src.notices(until=1)
    assert done == ["req-1"] and failed == [], (done, failed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_staged_tp2_to_tp1_between_processes_is_byte_exact(backend, device, sources):
    """Two TP-2 source processes (half the heads each) -> one TP-1 reader: the staged reshard path."""
    halves = [start(sources, backend, f"vram-tp{r}-{backend}", device, tp_size=2, tp_rank=r, global_rank=r)
              for r in range(2)]
    src_ids, dst_ids = ids_for("scattered")
    with reader(backend, f"vram-tp-{backend}-reader", device) as dst:
        handle = begin_pull_from_peers(dst, [(h.meta, src_ids) for h in halves], dst_ids, request_id="tp")
        handle.wait(timeout_s=60)
        if device == "cuda":
            torch.cuda.synchronize()
        assert same_bytes(dst.memory_buffer, expected_after(src_ids, dst_ids))
    for half in halves:
        done, failed = half.notices(until=1)
        assert done == ["tp"] and failed == [], (half.spec.name, done, failed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_killed_source_leaves_destination_safe_and_reader_serving(backend, device, sources, monkeypatch):
    """Over TCP a read needs the source's CPU: the source is stopped, the pull posted, the source
    SIGKILLed. The pull must fail (never succeed with missing bytes), its blocks must become
    ``storage_safe``, and the same reader must then pull byte-exact from a live source."""
    tls = "tcp,cuda_copy" if device == "cuda" else "tcp"
    monkeypatch.setenv("UCX_TLS", tls)
    doomed = SourceProcess(SourceSpec(backend, f"vram-doomed-{backend}", 11, SHAPE, device=device, ucx_tls=tls))
    sources.append(doomed)
    live = start(sources, backend, f"vram-live-{backend}", device)
    every = list(range(NUM_BLOCKS))
    with reader(backend, f"vram-kill-{backend}-reader", device) as dst:
        dst.begin_pull_blocks(doomed.meta, [0], [0]).wait(timeout_s=60)  # connected: the stall hits the read
        doomed.stop()
        handle = dst.begin_pull_blocks(doomed.meta, every, every, request_id="doomed")
        time.sleep(0.1)
        doomed.kill()
        with pytest.raises(TransferError):
            handle.wait(timeout_s=SETTLE_S)
        deadline = time.monotonic() + SETTLE_S
        while not handle.storage_safe and time.monotonic() < deadline:
            time.sleep(0.02)
        assert handle.storage_safe, "a killed source left the destination unsafe"
        dst.begin_pull_blocks(live.meta, every, every, request_id="after").wait(timeout_s=60)
        if device == "cuda":
            torch.cuda.synchronize()
        assert same_bytes(dst.memory_buffer, global_kv(SHAPE, 11))
    done, _ = live.notices(until=1)
    assert done == ["after"]
