"""The ``nccl`` push backend: real processes on Gloo (CPU), NCCL where GPUs are.

The cross-process tests run one world of 4 ranks through every functional scenario
(``nccl_peer.py``) and one world of 3 in which a rank is SIGKILLed; each decode rank
checks its pool byte for byte against the slice of the seeded global tensor it
should hold, and that every other block is unchanged. The in-process tests cover
the pieces: the message is a function of the source ids only, gather/scatter
match the byte-plan oracle, headers catch mispairing, staging is reused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvxfer.backends.nccl import NcclBackend
from kvxfer.backends.nccl.push_plan import own_peer_geometry
from kvxfer.plan.pool import LocalPool
from kvxfer.plan.request import plan_pull
from kvxfer.backends.nccl.staging import ByteRows, StagingPool, pool_bytes
from kvxfer.backends.nccl.wire import HEADER_BYTES, MessageHeader
from kvxfer.errors import BackendUnavailableError, TransferError
from nccl_peer import run_world
from reshard_support import POOL_BLOCKS, apply_copy_plan, kv_backend, kv_layouts, kv_shard, random_tensor

WORLD_SCENARIOS = ["matched", "tp2to1", "tp1to2", "pp2to1", "replicas", "ssm", "empty", "misorder",
                   "timeout_then_recover"]


def _ok(result: dict) -> None:
    assert "exception" not in result, result["exception"]


@pytest.fixture(scope="module")
def world() -> dict:
    return run_world(4, WORLD_SCENARIOS, timeout_s=90)


@pytest.fixture(scope="module")
def killed() -> dict:
    return run_world(3, ["killed_peer"], timeout_s=60)


# --- in-process -----------------------------------------------------------------------------------
def test_without_a_process_group_it_says_what_to_do():
    assert not torch.distributed.is_initialized()
    with pytest.raises(BackendUnavailableError, match="init_process_group"):
        NcclBackend("x", torch.zeros(2, 2, POOL_BLOCKS, 4, 2, 8), POOL_BLOCKS)
    ok, why = NcclBackend.availability()
    assert ok, why
    assert "process_group" in NcclBackend.transport_probe()


def _tp_pair(src_tp: int, dst_tp: int):
    """Local (no transport) prefill rank 0 of TP ``src_tp`` and decode rank 0 of TP ``dst_tp``, + the global tensor."""
    g = random_tensor((2, 4, POOL_BLOCKS, 4, 4, 8), torch.bfloat16, seed=5)
    src_layout = kv_layouts(src_tp, 1, 4, 4)[0]
    dst_layout = kv_layouts(dst_tp, 1, 4, 4, rank_base=10)[0]
    src = kv_backend(src_layout, kv_shard(g, src_layout), "src")
    dst = kv_backend(dst_layout, torch.zeros_like(kv_shard(g, dst_layout)), "dst")
    return src, dst


@pytest.mark.parametrize("tps", [(1, 1), (2, 1), (1, 2)], ids=["matched", "tp2to1", "tp1to2"])
def test_push_plan_is_the_decode_plan_and_ignores_destination_ids(tps):
    """The prefill's plan for the decode equals the decode's own ``plan_pull``, and the
    bytes it gathers (the message) are the same whatever the destination ids are."""
    src, dst = _tp_pair(*tps)
    try:
        src_ids = np.array([3, 4, 5, 9, 20, 21])
        decode_peer = src.parse_peer_meta(dst.export_meta())
        streams = []
        for dst_ids in (np.array([30, 31, 2, 7, 8, 0]), np.arange(6), np.array([1, 3, 5, 7, 9, 11])):
            pushed = plan_pull(LocalPool.from_peer(decode_peer), own_peer_geometry(src),
                                                  src_ids, dst_ids)
            pulled = dst.plan_pull(dst.parse_peer_meta(src.export_meta()), src_ids, dst_ids)
            for a, b in ((pushed.src_offsets, pulled.src_offsets), (pushed.dst_offsets, pulled.dst_offsets),
                         (pushed.lengths, pulled.lengths)):
                np.testing.assert_array_equal(a, b)
            rows = ByteRows(pushed.src_offsets, pushed.lengths, torch.device("cpu"))
            out = torch.empty(rows.total_bytes, dtype=torch.uint8)
            rows.gather(pool_bytes(src.memory_buffer), out)
            streams.append(out)
        assert all(torch.equal(streams[0], s) for s in streams[1:])
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize("tps", [(1, 1), (2, 1), (1, 2)], ids=["few-rows", "index-path-2to1", "index-path-1to2"])
def test_gather_then_scatter_equals_the_byte_plan_oracle(tps):
    src, dst = _tp_pair(*tps)
    try:
        src_ids, dst_ids = np.array([3, 4, 5, 9, 20, 21]), np.array([30, 31, 2, 7, 8, 0])
        plan = dst.plan_pull(dst.parse_peer_meta(src.export_meta()), src_ids, dst_ids)
        oracle = dst.memory_buffer.clone()
        apply_copy_plan(plan, src.memory_buffer, oracle)
        send = ByteRows(plan.src_offsets, plan.lengths, torch.device("cpu"))
        recv = ByteRows(plan.dst_offsets, plan.lengths, torch.device("cpu"))
        message = torch.empty(send.total_bytes, dtype=torch.uint8)
        send.gather(pool_bytes(src.memory_buffer), message)
        recv.scatter(message, pool_bytes(dst.memory_buffer))
        assert torch.equal(dst.memory_buffer.view(torch.uint8), oracle.view(torch.uint8))
        if tps != (1, 1):
            assert send.unit > 1 and plan.num_descriptors > 8  # one indexed copy, not a loop over rows
    finally:
        src.close()
        dst.close()


def test_header_catches_every_mispairing():
    ids = np.array([3, 4, 5])
    expected = MessageHeader.for_request("kv", 0, 1, ids, 1000)
    expected.check_received(expected.encode())
    for other, match in ((MessageHeader.for_request("kv", 0, 1, np.array([3, 4, 6]), 1000), "different request"),
                         (MessageHeader.for_request("kv", 0, 1, ids, 999), "disagree on the block count"),
                         (MessageHeader.for_request("kv", 2, 1, ids, 1000), "expected 0 -> 1")):
        with pytest.raises(TransferError, match=match):
            expected.check_received(other.encode())
    with pytest.raises(TransferError, match="not a kvxfer nccl message"):
        expected.check_received(torch.zeros(HEADER_BYTES, dtype=torch.uint8))
    assert MessageHeader.for_request("conv", 0, 1, ids, 1000).fingerprint != expected.fingerprint


def test_staging_pool_reuses_buffers_and_bounds_its_cache():
    pool = StagingPool(torch.device("cpu"), max_cached_bytes=1 << 20)
    a = pool.acquire(70_000)
    assert a.tensor.numel() == 70_000 and a.buffer.numel() == 1 << 17
    pool.release(a)
    b = pool.acquire(100_000)  # same power-of-two capacity: the same buffer again
    assert b.buffer.data_ptr() == a.buffer.data_ptr() and pool.allocations == 1
    big = pool.acquire(3 << 20)
    pool.release(big)  # beyond the cache bound: freed, not kept
    assert pool.cached_bytes == 0


# --- real processes, Gloo --------------------------------------------------------------------------
@pytest.mark.parametrize("scenario", ["matched", "tp2to1", "tp1to2", "pp2to1", "replicas"])
def test_kv_push_bytes_land_exactly(world, scenario):
    results = world[scenario]
    decodes = {r: v for r, v in results.items() if v is not None and "bytes_ok" in v}
    assert decodes, results
    for rank, result in results.items():
        if result is not None:
            _ok(result)
    for rank, result in decodes.items():
        assert result["bytes_ok"] and result["untouched_ok"], (rank, result)
        assert result["staging_allocations"] <= 2, result  # one staging buffer per message, reused


def test_two_requests_in_flight_pair_in_order(world):
    assert world["matched"][0]["sent"] == [True, True]


def test_only_the_first_head_replica_pushes(world):
    assert world["replicas"][0]["sent"] == [True] and world["replicas"][1]["sent"] == [False]


def test_ssm_conv_and_recurrent_slots(world):
    merged: dict = {}
    for result in world["ssm"].values():
        if result is not None:
            _ok(result)
            merged.update(result)
    for kind in ("conv", "recurrent"):
        for case in ("tp2to1", "tp1to2"):
            assert merged[f"{kind}_{case}_bytes_ok"] and merged[f"{kind}_{case}_untouched_ok"], (kind, case, merged)


def test_empty_requests_post_nothing(world):
    prefill, decode = world["empty"][0], world["empty"][1]
    _ok(prefill), _ok(decode)
    assert prefill["empty_completed"] and decode["empty_completed"]
    assert decode["sibling_shares_transport"]  # new_registered_buffer: same group, same staging
    assert decode["bytes_ok"] and decode["untouched_ok"]  # the next transfer still paired: nothing stray was posted


def test_misordered_pushes_fail_cleanly_and_write_nothing(world):
    decode = world["misorder"][1]
    _ok(decode)
    assert decode["pool_untouched"]
    assert [e is not None and "different request" in e[0] and e[1] for e in decode["errors"]] == [True, True]


def test_timeout_is_safe_refuses_the_pair_then_recovers(world):
    r = world["timeout_then_recover"][1]
    _ok(r)
    assert r["timed_out"] and 0.9 < r["elapsed_s"] < 3.0
    assert r["storage_safe"] and r["pool_untouched"]
    assert r["refused_while_posted"] and "still posted" in r["refused_while_posted"]
    assert r["late_push_not_written"]  # the late message landed in the set-aside staging, not the pool
    assert r["recovered_bytes_ok"] and r["recovered_untouched_ok"]


def test_killed_peer_fails_fast_with_the_group_error(killed):
    results = killed["killed_peer"]
    assert set(results) == {0, 2}, results  # rank 1 was killed
    for rank, r in results.items():
        _ok(r)
        assert r["error"] and "Connection closed by peer" in r["error"], (rank, r)
        assert r["elapsed_s"] < 10, r  # well within the 20 s handle timeout; nothing hangs
        assert r["storage_safe"] and r["pool_untouched"]
        assert r["refused_after"] and "recreate the process group" in r["refused_after"].lower()


# --- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gather_scatter_and_staging_on_cuda():
    src, dst = _tp_pair(2, 1)
    try:
        src_ids, dst_ids = np.array([3, 4, 5, 9, 20, 21]), np.array([30, 31, 2, 7, 8, 0])
        plan = dst.plan_pull(dst.parse_peer_meta(src.export_meta()), src_ids, dst_ids)
        oracle = dst.memory_buffer.clone()
        apply_copy_plan(plan, src.memory_buffer, oracle)
        device = torch.device("cuda")
        staging = StagingPool(device)
        src_pool, dst_pool = src.memory_buffer.to(device), dst.memory_buffer.to(device)
        lease = staging.acquire(plan.total_bytes)
        ByteRows(plan.src_offsets, plan.lengths, device).gather(pool_bytes(src_pool), lease.tensor)
        ByteRows(plan.dst_offsets, plan.lengths, device).scatter(lease.tensor, pool_bytes(dst_pool))
        torch.cuda.synchronize()
        assert torch.equal(dst_pool.cpu().view(torch.uint8), oracle.view(torch.uint8))
    finally:
        src.close()
        dst.close()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL refuses two ranks on one GPU; needs 2 GPUs")
def test_nccl_push_between_gpus():
    results = run_world(2, ["matched"], timeout_s=120, pg_backend="cpu:gloo,cuda:nccl")
    _ok(results["matched"][0])
    decode = results["matched"][1]
    _ok(decode)
    assert decode["bytes_ok"] and decode["untouched_ok"]
