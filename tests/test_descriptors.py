"""The planner against a direct byte copy: apply the plan with numpy, compare with indexing."""

import time

import numpy as np
import pytest
import torch

from kvxfer.plan.descriptors import CopyPlan, block_runs, check_plan_bounds, coalesce, plan_block_copies, validate_block_ids
from kvxfer.errors import BlockIdError, PeerMetadataError
from kvxfer.plan.geometry import compute_buffer_geometry
from tests.conftest import DTYPES, random_pool


def apply_plan(plan: CopyPlan, src: torch.Tensor, dst: torch.Tensor) -> None:
    """A tiny byte copier: what a transport does with the plan."""
    s, d = src.view(torch.uint8).view(-1).numpy(), dst.view(torch.uint8).view(-1).numpy()
    for so, do, n in zip(plan.src_offsets, plan.dst_offsets, plan.lengths):
        d[do:do + n] = s[so:so + n]


def _pools(dtype, src_blocks=16, dst_blocks=12):
    src = random_pool((2, 3, src_blocks, 4, 2, 8), dtype, seed=1)
    dst = torch.zeros((2, 3, dst_blocks, 4, 2, 8), dtype=dtype)
    return src, dst


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(5))
def test_plan_copies_exactly_the_requested_blocks(dtype, seed):
    src, dst = _pools(dtype)
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 12))
    src_ids, dst_ids = rng.choice(16, n, replace=False), rng.choice(12, n, replace=False)
    gs, gd = (compute_buffer_geometry(t, t.shape[2], backend_name="t") for t in (src, dst))
    plan = plan_block_copies(gs, gd, src_ids, dst_ids)
    apply_plan(plan, src, dst)
    expected = torch.zeros_like(dst)
    expected[:, :, dst_ids] = src[:, :, src_ids]
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))
    assert plan.total_bytes == n * 6 * gs.bytes_per_slice
    assert plan.raw_descriptors == n * 6


def test_adjacent_blocks_merge_into_runs():
    src, dst = _pools(torch.float32)
    gs, gd = (compute_buffer_geometry(t, t.shape[2], backend_name="t") for t in (src, dst))
    plan = plan_block_copies(gs, gd, [3, 4, 5, 9, 10], [0, 1, 2, 7, 8])
    assert plan.num_descriptors == 2 * 6 and plan.raw_descriptors == 5 * 6
    assert sorted(set(plan.lengths.tolist())) == [2 * gs.bytes_per_slice, 3 * gs.bytes_per_slice]


def test_whole_pool_merges_across_outer_slices():
    src = torch.zeros(2, 3, 8, 4)
    g = compute_buffer_geometry(src, 8, backend_name="t")
    plan = plan_block_copies(g, g, range(8), range(8))
    assert plan.num_descriptors == 1 and plan.total_bytes == src.numel() * 4


def test_block_runs():
    s, d, n = block_runs(np.array([1, 2, 3, 7, 8, 4]), np.array([5, 6, 9, 10, 11, 12]))
    assert s.tolist() == [1, 3, 7, 4] and d.tolist() == [5, 9, 10, 12] and n.tolist() == [2, 1, 2, 1]


def test_coalesce_merges_only_rows_touching_on_both_sides():
    s, d, n = coalesce(np.array([0, 10, 30]), np.array([0, 10, 25]), np.array([10, 10, 5]))
    assert (s.tolist(), d.tolist(), n.tolist()) == ([0, 30], [0, 25], [20, 5])


@pytest.mark.parametrize("src_ids, dst_ids, message", [
    ([1, 2], [1], "2 source block ids but 1 destination"),
    ([1, 16], [0, 1], "source block id 16 is outside"),
    ([-1], [0], "source block id -1"),
    ([1], [12], "destination block id 12"),
    ([1, 2], [3, 3], "destination block id 3 appears more than once"),
    ([4, 4], [1, 2], "source block id 4 appears more than once"),
    ([1.5], [2.0], "must be ints"),
    ([[1]], [[2]], "flat list"),
])
def test_bad_block_ids(src_ids, dst_ids, message):
    with pytest.raises(BlockIdError, match=message):
        validate_block_ids(src_ids, dst_ids, 16, 12)


def test_mismatched_slices_are_refused():
    a = compute_buffer_geometry(torch.zeros(2, 3, 8, 4), 8, backend_name="t")
    b = compute_buffer_geometry(torch.zeros(2, 3, 8, 5), 8, backend_name="t")
    with pytest.raises(PeerMetadataError, match="same shape"):
        plan_block_copies(a, b, [0], [0])


def test_bounds_are_checked_in_one_place():
    g = compute_buffer_geometry(torch.zeros(2, 8, 4), 8, backend_name="t")
    bad = CopyPlan(np.array([g.region_bytes - 8]), np.array([0]), np.array([16]), 1)
    with pytest.raises(PeerMetadataError, match="leaves the source region"):
        check_plan_bounds(bad, g, g)


def test_large_scattered_plan_is_array_built():
    """4,096 blocks x 64 outer slices with random ids: rows are built without a per-block loop."""
    pool = torch.empty((64, 4096, 1), dtype=torch.uint8)
    g = compute_buffer_geometry(pool, 4096, backend_name="t")
    rng = np.random.default_rng(0)
    src, dst = rng.permutation(4096), rng.permutation(4096)
    t0 = time.perf_counter()
    plan = plan_block_copies(g, g, src, dst)
    elapsed = time.perf_counter() - t0
    assert plan.raw_descriptors == 4096 * 64
    assert plan.num_descriptors <= plan.raw_descriptors
    # the bytes are right: every (outer, block) slice lands at its destination
    expected_dst = (np.arange(64)[:, None] * 4096 + dst[None, :]).ravel()
    got = np.sort(plan.dst_offsets)
    assert np.array_equal(got, np.sort(expected_dst))
    print(f"plan for 4096 blocks x 64 slices: {elapsed * 1e3:.1f} ms, {plan.num_descriptors} rows")
