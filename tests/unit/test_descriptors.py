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


# --- the short-request path (plain Python) plans exactly what the numpy path plans ------------------
from contextlib import contextmanager  # noqa: E402

from hypothesis import given, settings, strategies as st  # noqa: E402

import kvxfer.plan.descriptors as descriptors  # noqa: E402


@contextmanager
def _numpy_only():
    saved = descriptors.SMALL_IDS
    descriptors.SMALL_IDS = -1
    try:
        yield
    finally:
        descriptors.SMALL_IDS = saved


def _outcome(src_geometry, dst_geometry, src_ids, dst_ids):
    try:
        plan = plan_block_copies(src_geometry, dst_geometry, src_ids, dst_ids)
    except (BlockIdError, PeerMetadataError) as exc:
        return type(exc), str(exc)
    return plan.src_offsets.tolist(), plan.dst_offsets.tolist(), plan.lengths.tolist(), plan.raw_descriptors


@settings(max_examples=300, deadline=None)
@given(outer=st.integers(1, 4), src_blocks=st.integers(6, 30), dst_blocks=st.integers(6, 30), data=st.data())
def test_short_request_path_plans_what_the_numpy_path_plans(outer, src_blocks, dst_blocks, data):
    """Same rows (merged the same way), same raw count, same error and message, on any ids: runs,
    scatter, repeats, ids outside either pool, lists of different lengths."""
    src = torch.zeros((outer, src_blocks, 97, 5), dtype=torch.bfloat16)  # no other axis of the block count
    dst = torch.zeros((outer, dst_blocks, 97, 5), dtype=torch.bfloat16)
    gs, gd = (compute_buffer_geometry(t, t.shape[1], backend_name="t") for t in (src, dst))
    n = data.draw(st.integers(0, 12))
    ids = st.integers(-2, max(src_blocks, dst_blocks) + 1)
    src_ids = data.draw(st.lists(ids, min_size=n, max_size=n))
    dst_ids = data.draw(st.lists(ids, min_size=n, max_size=n + data.draw(st.integers(0, 1))))
    short = _outcome(gs, gd, src_ids, dst_ids)
    with _numpy_only():
        numpy_path = _outcome(gs, gd, np.array(src_ids, dtype=np.int64), np.array(dst_ids, dtype=np.int64))
    assert short == numpy_path


def test_short_request_path_is_taken_for_a_list_of_ints_and_copies_exactly():
    src, dst = _pools(torch.float16)
    gs, gd = (compute_buffer_geometry(t, t.shape[2], backend_name="t") for t in (src, dst))
    src_ids, dst_ids = [3, 4, 5, 9, 0], [0, 1, 2, 7, 11]
    calls = []
    real = descriptors._small_block_copies
    descriptors._small_block_copies = lambda *a: calls.append(a) or real(*a)
    try:
        plan = plan_block_copies(gs, gd, src_ids, dst_ids)
    finally:
        descriptors._small_block_copies = real
    assert len(calls) == 1
    apply_plan(plan, src, dst)
    expected = torch.zeros_like(dst)
    expected[:, :, dst_ids] = src[:, :, src_ids]
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("src_ids,dst_ids", [
    (list(range(8)), list(range(8))),             # whole pools: one row across every outer slice
    ([0, 1, 2, 5, 6], [3, 4, 5, 0, 1]),           # two runs
    ([7, 6, 5], [0, 1, 2]),                       # descending on one side: no run
    ([], []),
])
def test_short_request_path_merges_as_the_numpy_path(src_ids, dst_ids):
    src = torch.zeros((3, 8, 97, 5), dtype=torch.float16)
    gs = compute_buffer_geometry(src, 8, backend_name="t")
    short = _outcome(gs, gs, src_ids, dst_ids)
    with _numpy_only():
        assert short == _outcome(gs, gs, np.array(src_ids, dtype=np.int64), np.array(dst_ids, dtype=np.int64))
    if src_ids == list(range(8)):
        assert len(short[2]) == 1, short  # one row
