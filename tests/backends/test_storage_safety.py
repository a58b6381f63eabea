"""The failure contract as callers read it: an exception that is not a ``TimeoutError`` means
no byte of the transfer can land any more (issue 21, section 1).

Megatron's waiter (``megatron_driver.wait_for_transfer_handles``, written from Megatron's
``_wait_for_transfer_handles``) frees the destination on any exception but a
``TimeoutError``. Every test here drives real sources in their own processes
(``tests/support/pull_source.py``) over UCX's TCP transport, the one where a read needs the
source's CPU, so that a SIGSTOPped source really stalls a read mid-way; then checks that
whatever the waiter concludes is true: when it says "free", the blocks are reused at once
by another request, and after the stalled source resumes (or dies) not one byte of the
first request lands in them.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))

from megatron_driver import wait_for_transfer_handles  # noqa: E402
from pull_source import SourceProcess, SourceSpec, closing_sources, global_kv  # noqa: E402

from kvxfer.backends import construct_kv_transfer_backend_class  # noqa: E402
from kvxfer.errors import PeerMetadataError, TransferError, TransferTimeoutError  # noqa: E402

SHAPE = (2, 4, 60, 32, 8, 64)  # bf16: 31.5 MiB, seconds over TCP, so a SIGSTOP lands mid-read
NUM_BLOCKS = SHAPE[2]
ALL = list(range(NUM_BLOCKS))
TIMEOUT_S = 1.0
SETTLE_S = 15.0  # a resumed or killed source must end the late read within this

#: (backend, decode keyword arguments): nixl; ucx choosing per source (over TCP that is UCX's peer
#: failure mode); ucx forced onto the same-host path without it (gets that a force-close cannot end)
MODES = {
    "nixl": ("nixl", {}),
    "ucx": ("ucx", {}),
    "ucx-no-peer-mode": ("ucx", {"peer_error_handling": False}),
}


@pytest.fixture
def tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp")  # the decode's UCX reads it when its backend is built


@pytest.fixture
def sources() -> Iterator[list[SourceProcess]]:
    """Sources a test starts; all resumed and closed at the end, whatever happened."""
    with closing_sources() as started:
        yield started


def start(sources: list[SourceProcess], backend: str, name: str, seed: int, **layout: Any) -> SourceProcess:
    source = SourceProcess(SourceSpec(backend, name, seed, SHAPE, ucx_tls="tcp", **layout))
    sources.append(source)
    return source


_SHARED: dict[tuple, SourceProcess] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_shared_sources() -> Iterator[None]:
    yield
    for source in _SHARED.values():
        source.close()
    _SHARED.clear()


def shared(backend: str, seed: int, **layout: Any) -> SourceProcess:
    """A source that no test stops or kills (the one whose bytes reuse the blocks): started once."""
    key = (backend, seed, tuple(sorted(layout.items())))
    source = _SHARED.get(key)
    if source is None or source.proc.poll() is not None:
        name = f"shared-{backend}-{seed}-" + "-".join(f"{k}{v}" for k, v in sorted(layout.items()))
        source = _SHARED[key] = SourceProcess(SourceSpec(backend, name, seed, SHAPE, ucx_tls="tcp", **layout))
    return source


def decode_backend(mode: str, name: str, **extra: Any) -> Any:
    """The decode side, in this process: the whole model (TP 1, PP 1), an empty pool.

    Its own timeout is long; the tests time a pull out with ``wait(timeout_s=TIMEOUT_S)``
    (the same abort as the handle's own timeout), so that the pull after it has time.
    """
    backend, kwargs = MODES[mode]
    spec = SourceSpec(backend, name, 0, SHAPE, global_rank=100)
    cls = construct_kv_transfer_backend_class(backend)
    return cls(name, torch.zeros(SHAPE, dtype=torch.bfloat16), NUM_BLOCKS, timeout_s=30.0,
               **spec.layout_kwargs(), **kwargs, **extra)


def post_and_stall(dst: Any, meta: Any, stall: list[SourceProcess], *, src: Any = ALL, dst_ids: Any = ALL,
                   request_id: str) -> Any:
    """Post a pull, then SIGSTOP ``stall`` while it is in flight. On a loaded machine the read can
    win that race: then the sources are stopped first and the pull posted again (still in flight
    when the test goes on, if no longer stopped mid-way)."""
    handle = dst.begin_pull_blocks(meta, src, dst_ids, request_id=request_id)
    for source in stall:
        source.stop()
    time.sleep(0.05)
    if not handle.poll():
        return handle
    print(f"{request_id}: the read finished before its source stopped; posting again behind the stop")
    handle = dst.begin_pull_blocks(meta, src, dst_ids, request_id=f"{request_id}-again")
    time.sleep(0.05)
    assert not handle.poll(), "a pull from a stopped source completed"
    return handle


def time_out(handle: Any) -> None:
    with pytest.raises(TransferError):
        handle.wait(timeout_s=TIMEOUT_S)


def wait_until(predicate: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def check_raised_class_follows_storage(handle: Any) -> bool:
    """What Megatron's waiter concludes, asserted to match ``storage_safe`` (and the class raised)."""
    free = wait_for_transfer_handles(handle)
    assert free == handle.storage_safe, (free, handle.storage_safe)
    with pytest.raises(TransferError) as raised:
        handle.wait()
    assert isinstance(raised.value, TimeoutError) == (not handle.storage_safe), raised.value
    return free


def reuse_and_check_no_late_byte(dst: Any, stalled: Any, reuse: SourceProcess, *, free_now: bool,
                                 resume: Any) -> None:
    """The waiter's verdict, tested: reuse the blocks as soon as it says free; then let the stalled
    read end (``resume``); the blocks must hold exactly the second request's bytes."""
    if free_now:
        dst.begin_pull_blocks(reuse.meta, ALL, ALL, request_id="reuse").wait()
    resumed_at = time.monotonic()
    resume()
    assert wait_until(lambda: stalled.storage_safe, SETTLE_S), "the stalled read never ended"
    print(f"{stalled.request_id}: storage {'safe at the failure' if free_now else 'unsafe at the failure'}; "
          f"safe {time.monotonic() - resumed_at:.2f}s after the source resumed or died")
    assert wait_for_transfer_handles(stalled), "storage safe, yet the waiter was told to keep it"
    if not free_now:
        dst.begin_pull_blocks(reuse.meta, ALL, ALL, request_id="reuse").wait()
    time.sleep(1.0)  # room for a late byte to land, were one still coming
    assert same_bytes(dst.memory_buffer, reuse.expected_pool()), "a late byte of the first request landed"


@pytest.mark.parametrize("mode", list(MODES))
def test_stalled_source_then_resumed_never_corrupts_reused_blocks(mode, tcp, sources):
    """A1: the pull times out while the source is stopped; the blocks are reused the moment the
    waiter allows it; the source resumes; the reused blocks stay exact."""
    backend = MODES[mode][0]
    first, second = start(sources, backend, f"a1-{mode}-first", 1), shared(backend, 2)
    with decode_backend(mode, f"a1-{mode}-decode") as dst:
        dst.begin_pull_blocks(first.meta, [0], [0]).wait()  # connected: the stall hits the read itself
        handle = post_and_stall(dst, first.meta, [first], request_id="stalled")
        time_out(handle)
        free_now = check_raised_class_follows_storage(handle)
        if backend == "nixl":  # NIXL cannot cancel an active READ: it must not call it safe
            assert not free_now and dst.stats()["storage_unsafe"] == 1
        reuse_and_check_no_late_byte(dst, handle, second, free_now=free_now, resume=first.resume)
        assert dst.stats()["storage_unsafe"] == 0
    done, failed = first.notices(until=1)
    assert done.count(handle.request_id) + failed.count(handle.request_id) == 1, (done, failed)


@pytest.mark.parametrize("mode", list(MODES))
def test_stalled_source_then_killed_frees_only_when_nothing_can_land(mode, tcp, sources):
    backend = MODES[mode][0]
    first, second = start(sources, backend, f"kill-{mode}-first", 3), shared(backend, 2)
    with decode_backend(mode, f"kill-{mode}-decode") as dst:
        dst.begin_pull_blocks(first.meta, [0], [0]).wait()
        handle = post_and_stall(dst, first.meta, [first], request_id="stalled")
        time_out(handle)
        free_now = check_raised_class_follows_storage(handle)
        killed_at = []
        reuse_and_check_no_late_byte(dst, handle, second, free_now=free_now,
                                     resume=lambda: (first.kill(), killed_at.append(time.monotonic())))
        print(f"{mode}: safe {'at the timeout' if free_now else 'after the kill'}")


@pytest.mark.parametrize("mode", ["nixl", "ucx"])
def test_staged_reshard_never_hands_a_stalled_range_to_another_pull(mode, tcp, sources):
    """A2: a staged TP 2->1 pull times out on stalled sources; a second pull on the same backend
    must not be given the staging its late bytes can still hit."""
    backend = MODES[mode][0]
    tp = lambda seed, tag, rank: start(sources, backend, f"a2-{mode}-{tag}{rank}", seed,  # noqa: E731
                                       tp_size=2, tp_rank=rank, global_rank=rank)
    stalled = [tp(5, "a", r) for r in (0, 1)]
    live = [shared(backend, 6, tp_size=2, tp_rank=r, global_rank=r) for r in (0, 1)]
    with decode_backend(mode, f"a2-{mode}-decode", staging_bytes=16 << 20) as dst:
        few = [0, 1]
        dst.begin_pull_blocks({"tp_metas": [s.meta for s in stalled]}, few, few).wait()
        first = post_and_stall(dst, {"tp_metas": [s.meta for s in stalled]}, stalled, request_id="A")
        assert [p.path for p in first.parts] == ["staged", "staged"]
        time_out(first)
        check_raised_class_follows_storage(first)  # the pool is written only by placements: free
        quarantined = dst.stats()["staging_quarantined"]
        second = dst.begin_pull_blocks({"tp_metas": [s.meta for s in live]}, ALL, ALL, request_id="B")
        second.wait(30)
        assert same_bytes(dst.memory_buffer, global_kv(SHAPE, 6)), "pull B reported success with wrong bytes"
        for s in stalled:
            s.resume()
        assert wait_until(lambda: dst.stats()["staging_quarantined"] == 0, SETTLE_S)
        time.sleep(1.0)
        assert same_bytes(dst.memory_buffer, global_kv(SHAPE, 6))
        print(f"{mode}: {quarantined} B of staging quarantined while the stalled reads could land")
        if backend == "nixl":
            assert quarantined > 0
    for s in stalled:  # each source hears once: its read failed, or completed late
        done, failed = s.notices(until=1)
        assert done.count(first.request_id) + failed.count(first.request_id) == 1, (s.spec.name, done, failed)


@pytest.mark.parametrize("mode", ["nixl", "ucx-no-peer-mode"])
def test_group_with_a_dead_and_a_stalled_stage_raises_timeout_until_both_are_over(mode, tcp, sources):
    """A5: PP 2 -> 1, one stage's source killed, the other's stalled: the group must not raise a
    plain error while the stalled stage's read can still land."""
    backend = MODES[mode][0]
    stages = [start(sources, backend, f"a5-{mode}-pp{p}", 7, pp_size=2, pp_rank=p, global_rank=p) for p in (0, 1)]
    reuse = shared(backend, 2)
    wrapped = {"pp_metas": [{"tp_metas": s.meta, "block_ids": ALL} for s in stages]}
    with decode_backend(mode, f"a5-{mode}-decode") as dst:
        dst.begin_pull_blocks({"pp_metas": [{"tp_metas": s.meta, "block_ids": [0]} for s in stages]}, [], [0]).wait()
        group = post_and_stall(dst, wrapped, [stages[1]], src=[], request_id="group")
        stages[0].kill()
        with pytest.raises(TransferTimeoutError):
            group.wait(timeout_s=TIMEOUT_S)
        assert not group.storage_safe and any(not part.storage_safe for part in group.parts)
        assert not wait_for_transfer_handles(group)
        reuse_and_check_no_late_byte(dst, group, reuse, free_now=False, resume=stages[1].resume)


@pytest.mark.parametrize("mode", ["nixl", "ucx"])
def test_close_while_reads_are_posted_keeps_the_memory_until_they_end(mode, tcp, sources):
    """An abort of everything (``close()``) with reads posted to a stalled source."""
    from kvxfer.backends.nixl.backend import parked_registrations

    backend = MODES[mode][0]
    source = start(sources, backend, f"close-{mode}-src", 9)
    dst = decode_backend(mode, f"close-{mode}-decode")
    dst.begin_pull_blocks(source.meta, [0], [0]).wait()
    handle = post_and_stall(dst, source.meta, [source], request_id="closed")
    started = time.monotonic()
    dst.close()
    assert time.monotonic() - started < 5.0  # bounded
    assert check_raised_class_follows_storage(handle) == handle.storage_safe
    if backend == "nixl":
        # NIXL cannot stop the READ: the registration (and the tensor) are kept, not freed under it
        assert not handle.storage_safe and parked_registrations() == 1
        source.resume()
        assert wait_until(lambda: parked_registrations() == 0, SETTLE_S)
        assert handle.storage_safe
    else:
        assert handle.storage_safe  # ucx destroys its worker on close: no get can write after that
        source.resume()


def test_refused_generations_meta_is_refused_before_any_byte_moves():
    """A4: a verified pull whose generations meta is refused fails at once, nothing posted, and a
    verified pull whose check cannot start ends (no PROC past its timeout) and tells the source."""
    from kvxfer.handoff.generations import BlockGenerations, GenerationChecker

    cls = construct_kv_transfer_backend_class("nixl")
    src_pool = global_kv(SHAPE, 11)
    with cls("a4-src", src_pool, NUM_BLOCKS) as src, \
            cls("a4-dst", torch.zeros_like(src_pool), NUM_BLOCKS, timeout_s=TIMEOUT_S) as dst:
        gens, checker = BlockGenerations(src), GenerationChecker(dst)
        try:
            forged = {**gens.export_meta(), "num_blocks": NUM_BLOCKS + 1}
            with pytest.raises(PeerMetadataError):
                checker.begin_pull_verified(src.export_meta(), forged, [1, 2], [3, 4], [0, 0], request_id="forged")
            assert dst.stats()["transfers_started"] == 0
            assert not dst.memory_buffer[:, :, [3, 4]].any()

            handle = checker.begin_pull_verified(src.export_meta(), gens.export_meta(), [1, 2], [3, 4], [0, 0],
                                                 request_id="unchecked")
            checker.close()  # the decode shuts down between the data read and the check
            with pytest.raises(TransferError):
                handle.wait()
            assert handle.state.value == "ERR" and handle.storage_safe
            assert wait_until(lambda: any(f.request_id == "unchecked" for f in gens.drain_read_failed()), 5.0)
        finally:
            checker.close()
            gens.close()


def test_in_flight_is_not_left_counting_a_refused_post():
    local = construct_kv_transfer_backend_class("local")
    pool = global_kv(SHAPE, 12)
    source = local("inflight-src", pool, NUM_BLOCKS)
    meta = source.export_meta()
    source.close()  # the meta outlives its registration: refused when posting, after planning
    with local("inflight-dst", torch.zeros_like(pool), NUM_BLOCKS) as dst:
        for _ in range(3):
            with pytest.raises(PeerMetadataError):
                dst.begin_pull_blocks(meta, [1], [1])
        stats = dst.stats()
        assert stats["in_flight"] == 0 and stats["transfers_failed"] == 3
        assert np.all(dst.memory_buffer.view(torch.int16).numpy() == 0)


@pytest.fixture(autouse=True)
def nothing_of_ucx_left_behind() -> Iterator[None]:
    """Every UCX object a test's backends made is gone after it (pending gets included)."""
    from kvxfer.backends.ucx import binding as _ucp

    yield
    assert _ucp.live_objects() == {}


def test_nixl_same_host_mode_reads_zero_copy_refuses_other_hosts_and_survives_a_killed_source(monkeypatch, sources):
    """``KVXFER_NIXL_SAME_HOST=1``: NIXL's UCX without peer failure handling (CMA between processes).
    Bytes exact; a meta signed on another host refused before any byte moves; a source killed
    mid-pull fails its reads (or they completed), storage safe, the process unharmed."""
    from kvxfer.meta.seal import HOST_FIELD, seal_meta

    monkeypatch.setenv("KVXFER_NIXL_SAME_HOST", "1")
    monkeypatch.delenv("UCX_TLS", raising=False)
    source = SourceProcess(SourceSpec("nixl", "same-host-src", 13, SHAPE))
    sources.append(source)
    with decode_backend("nixl", "same-host-decode") as dst:
        dst.begin_pull_blocks(source.meta, ALL, ALL, request_id="whole").wait(30)
        assert same_bytes(dst.memory_buffer, source.expected_pool())
        key = b"k" * 32
        elsewhere = seal_meta({**{k: v for k, v in source.meta.items() if k != "meta_seal"}, HOST_FIELD: "elsewhere"}, key)
        with decode_backend("nixl", "same-host-keyed", meta_key=key) as keyed:
            with pytest.raises(PeerMetadataError, match="same-host mode"):
                keyed.begin_pull_blocks(elsewhere, [1], [1])
            assert keyed.stats()["transfers_started"] == 0
        handles = [dst.begin_pull_blocks(source.meta, ALL, ALL, request_id=f"k{i}") for i in range(4)]
        source.kill()
        for handle in handles:
            try:
                handle.wait(10)
            except TransferError:
                pass
            assert handle.storage_safe


def test_a_part_failing_to_start_behind_a_stalled_part_returns_a_failed_handle(tcp, sources):
    """Megatron reads a raised ``TransferStartError`` once and, unsafe, quarantines for good. So when
    part 2 of a TP 2->1 request cannot start (its source is dead) while part 1 is stalled mid-read,
    ``begin_pull_blocks`` returns a handle that has failed: a TimeoutError until part 1's read is
    over, then a plain error Megatron's waiter frees on."""
    stalled, dead = (start(sources, "nixl", f"start-fail-tp{r}", 14, tp_size=2, tp_rank=r, global_rank=r)
                     for r in (0, 1))
    stalled.meta, dead.meta  # both started
    dead.kill()  # never contacted by the decode: loading its agent fails
    with decode_backend("nixl", "start-fail-decode", staging_bytes=0) as dst:
        dst.begin_pull_blocks(stalled.meta, [0], [0]).wait()  # connected to the stalled one (a bare meta: its heads)
        stalled.stop()
        handle = dst.begin_pull_blocks({"tp_metas": [stalled.meta, dead.meta]}, ALL, ALL, request_id="half")
        assert handle.state.value == "ERR" and not handle.storage_safe
        with pytest.raises(TransferTimeoutError):
            handle.poll()
        assert not wait_for_transfer_handles(handle)
        assert dst.stats()["storage_unsafe"] == 1 and dst.stats()["in_flight"] == 0
        reuse_and_check_no_late_byte(dst, handle, shared("nixl", 2), free_now=False, resume=stalled.resume)
        assert dst.stats()["storage_unsafe"] == 0
