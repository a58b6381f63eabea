"""A prepared source's per-request planning (``kvxfer.plan.prepared.BlockCopier``) against the general planner.

The copier checks once what holds for every request between two pools and then only checks ids
and builds rows; it must give the general planner's rows and its errors, and take no pair the
general planner would plan differently (a reshard, pools whose blocks overrun their region).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvxfer.backends import construct_kv_transfer_backend_class
from kvxfer.errors import BlockIdError, PeerMetadataError
from kvxfer.meta.records import SourceRecord
from kvxfer.plan.geometry import PeerGeometry, compute_buffer_geometry
from kvxfer.plan.pool import LocalPool
from kvxfer.plan.prepared import BlockCopier
from kvxfer.plan.request import plan_request
from tests.unit.test_descriptors import apply_plan


def _pools(outer: int, src_blocks: int, dst_blocks: int, width: int = 97, dtype=torch.bfloat16):
    src = torch.zeros((outer, src_blocks, width, 5), dtype=dtype)
    dst = torch.zeros((outer, dst_blocks, width, 5), dtype=dtype)
    gs, gd = (compute_buffer_geometry(t, t.shape[1], backend_name="t") for t in (src, dst))
    return PeerGeometry(geometry=gs, dtype="bfloat16"), LocalPool(gd, "bfloat16")


def _general(peer: PeerGeometry, local: LocalPool, src_ids, dst_ids):
    try:
        plan = plan_request([SourceRecord({}, peer, src_ids)], dst_ids, local, whole=False)
    except (BlockIdError, PeerMetadataError) as exc:
        return type(exc), str(exc)
    record = plan.records[0]
    if record is None:
        return [], [], [], 0
    c = record.copy
    return c.src_offsets.tolist(), c.dst_offsets.tolist(), c.lengths.tolist(), c.raw_descriptors


def _prepared(copier: BlockCopier, src_ids, dst_ids):
    try:
        src, dst, c = copier.plan(src_ids, dst_ids)
    except (BlockIdError, PeerMetadataError) as exc:
        return type(exc), str(exc)
    assert src.tolist() == list(src_ids) and dst.tolist() == list(dst_ids)
    if not c.num_descriptors:
        return [], [], [], 0
    return c.src_offsets.tolist(), c.dst_offsets.tolist(), c.lengths.tolist(), c.raw_descriptors


def _rows(copier: BlockCopier, src_ids, dst_ids):
    """``BlockCopier.rows`` (what ucx's chained read posts, lists of Python ints on the short path)
    in ``_prepared``'s terms: the same rows, or the same error and message."""
    try:
        rows = copier.rows(src_ids, dst_ids)
    except (BlockIdError, PeerMetadataError) as exc:
        return type(exc), str(exc)
    assert all(type(x) is int for row in rows for x in row) or all(isinstance(row, np.ndarray) for row in rows)
    return tuple([int(x) for x in row] for row in rows)


@settings(max_examples=300, deadline=None)
@given(outer=st.integers(1, 4), src_blocks=st.integers(6, 40), dst_blocks=st.integers(6, 40), data=st.data())
def test_copier_plans_what_the_general_planner_plans(outer, src_blocks, dst_blocks, data):
    """Same rows, same raw count, same error and message, on any ids: runs, scatter, repeats,
    ids outside either pool, lists of different lengths, and numpy arrays (the general path)."""
    peer, local = _pools(outer, src_blocks, dst_blocks)
    copier = BlockCopier.for_pair(local, peer)
    assert copier is not None
    n = data.draw(st.integers(0, 30))
    ids = st.integers(-2, max(src_blocks, dst_blocks) + 1)
    src_ids = data.draw(st.lists(ids, min_size=n, max_size=n))
    dst_ids = data.draw(st.lists(ids, min_size=n, max_size=n + data.draw(st.integers(0, 1))))
    assert _prepared(copier, src_ids, dst_ids) == _general(peer, local, src_ids, dst_ids)
    assert _rows(copier, src_ids, dst_ids) == _prepared(copier, src_ids, dst_ids)[:3]
    if len(src_ids) == len(dst_ids):
        arrays = np.array(src_ids, dtype=np.int64), np.array(dst_ids, dtype=np.int64)
        assert _prepared(copier, *arrays) == _general(peer, local, *arrays)


def test_a_long_request_plans_as_the_general_planner_and_copies_exactly():
    """Past the plain-Python limits the copier hands the ids to numpy, as the general planner does."""
    src = torch.arange(3 * 5000 * 4, dtype=torch.float32).view(3, 5000, 4)
    dst = torch.zeros((3, 6000, 4))
    gs, gd = (compute_buffer_geometry(t, t.shape[1], backend_name="t") for t in (src, dst))
    peer, local = PeerGeometry(geometry=gs, dtype="float32"), LocalPool(gd, "float32")
    rng = np.random.default_rng(0)
    for n in (100, 4096, 4097):
        s = rng.choice(5000, n, replace=False).tolist()
        d = rng.choice(6000, n, replace=False).tolist()
        assert _prepared(BlockCopier.for_pair(local, peer), s, d) == _general(peer, local, s, d)
        dst.zero_()
        apply_plan(BlockCopier.for_pair(local, peer).plan(s, d)[2], src, dst)
        expected = torch.zeros_like(dst)
        expected[:, d] = src[:, s]
        assert torch.equal(dst, expected)


def test_pairs_the_general_planner_must_judge_get_no_copier():
    peer, local = _pools(2, 8, 8)
    assert BlockCopier.for_pair(local, peer) is not None
    wider, _ = _pools(2, 8, 8, width=98)
    assert BlockCopier.for_pair(local, wider) is None  # slices differ: the general planner refuses, in its words
    other_dtype = PeerGeometry(geometry=peer.geometry, dtype="float16")
    assert BlockCopier.for_pair(local, other_dtype) is None
    g = peer.geometry
    overrun = type(g)(**{**g.__dict__, "num_blocks": g.num_blocks + 1})  # blocks past the outer stride
    assert BlockCopier.for_pair(local, PeerGeometry(geometry=overrun, dtype="bfloat16")) is None
    with pytest.raises(PeerMetadataError, match="leaves the source region"):
        plan_request([SourceRecord({}, PeerGeometry(geometry=overrun, dtype="bfloat16"), [8])], [0], local, whole=False)


@pytest.mark.parametrize("name", ["ucx", "local"])
def test_a_prepared_pull_refuses_bad_ids_before_any_byte_moves(name):
    cls = construct_kv_transfer_backend_class(name)
    shape = (2, 24, 2, 4, 16)
    src = cls(f"copier-src-{name}", torch.randn(shape).to(torch.bfloat16), shape[1])
    dst = cls(f"copier-dst-{name}", torch.zeros(shape, dtype=torch.bfloat16), shape[1])
    try:
        prepared = dst.prepare_peer(src.export_meta())
        for s_ids, d_ids, message in (([24], [0], "outside the pool"), ([1, 2], [3, 3], "more than once"),
                                      ([1, 2], [3], "2 source block ids but 1")):
            with pytest.raises(BlockIdError, match=message):
                dst.begin_pull_blocks(prepared, s_ids, d_ids, request_id="bad", notify=False)
        assert dst.memory_buffer.abs().sum() == 0
        ids = list(range(23, -1, -1))
        dst.begin_pull_blocks(prepared, ids, list(range(24)), request_id="all", notify=False).wait()
        assert torch.equal(dst.memory_buffer.view(torch.int16), src.memory_buffer[:, ids].view(torch.int16))
        assert [type(copier) for _, copier in dst._copiers.values()] == [BlockCopier]  # the copier planned these
    finally:
        src.close()
        dst.close()
